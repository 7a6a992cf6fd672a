// Unit: the encoding of messages between ranks, and the UCX check macro's message.
#include "runtime/net/ucx.h"
#include "runtime/net/wire.h"
#include "tests/runtime/test_util.h"

namespace caravan::net {
namespace {

TEST(Wire, FieldsRoundTrip) {
  Event e = Event::from_parts(17, 3, 9, 123456789);
  WireWriter out;
  out.put(e).put(std::int32_t{-5}).put_string("net.task").put_bytes(std::vector<std::byte>(300, std::byte{7}));
  out.put_failure(make_failure(Errc::device, "tile 7 is corrupt")).put_failure(nullptr);
  WireReader in(out.bytes(), "test");
  EXPECT_EQ(in.get<Event>(), e);
  EXPECT_EQ(in.get<std::int32_t>(), -5);
  EXPECT_EQ(in.get_string(), "net.task");
  auto bytes = in.get_bytes();
  EXPECT_EQ(bytes.size(), 300u);
  EXPECT_EQ(bytes[299], std::byte{7});
  FailureCause failure = in.get_failure();
  ASSERT_NE(failure, nullptr);
  EXPECT_EQ(failure->code(), Errc::device);
  EXPECT_STREQ(failure->what(), "tile 7 is corrupt");
  EXPECT_EQ(in.get_failure(), nullptr);
  EXPECT_TRUE(in.at_end());
  EXPECT_NO_THROW(in.expect_end());
}

TEST(Wire, TruncatedAndOversizedMessagesAreErrors) {
  WireWriter out;
  out.put_string("a longer string");
  auto bytes = out.take();
  for (std::size_t cut = 0; cut < bytes.size(); ++cut) {
    WireReader in(std::span<const std::byte>(bytes).first(cut), "subscribe from rank 2");
    CARAVAN_EXPECT_ERROR(in.get_string(), Errc::internal, "malformed subscribe from rank 2");
  }
  WireReader extra(bytes, "notify");
  extra.get<std::uint8_t>();
  CARAVAN_EXPECT_ERROR(extra.expect_end(), Errc::internal, "bytes left over");
  // A failure with a code beyond Errc's range is rejected, not cast.
  WireWriter bad;
  bad.put(std::uint8_t{1}).put(std::uint8_t{200}).put_string("x");
  WireReader bad_in(bad.bytes(), "notify");
  CARAVAN_EXPECT_ERROR(bad_in.get_failure(), Errc::internal, "error code 200 is unknown");
}

TEST(Wire, MessageNames) {
  EXPECT_EQ(message_name(static_cast<std::uint16_t>(MsgId::subscribe)), "subscribe");
  EXPECT_EQ(message_name(kFirstUserMessage), "user");
  EXPECT_EQ(message_name(kMessageIdLimit), "unknown");
}

TEST(UcxCheck, MessageNamesCallPlaceStatusAndDescription) {
  try {
    CARAVAN_UCX_CHECK(UCS_ERR_UNREACHABLE);
    ADD_FAILURE() << "CARAVAN_UCX_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::transport);
    std::string message = e.what();
    EXPECT_NE(message.find("UCS_ERR_UNREACHABLE failed at tests/net/wire_test.cpp:"), std::string::npos) << message;
    EXPECT_NE(message.find("UCS_ERR_UNREACHABLE (Destination is unreachable)"), std::string::npos) << message;
  }
  EXPECT_NO_THROW(CARAVAN_UCX_CHECK(UCS_OK));
  EXPECT_EQ(ucs_status_name(UCS_ERR_ENDPOINT_TIMEOUT), "UCS_ERR_ENDPOINT_TIMEOUT");
  EXPECT_EQ(ucs_status_name(static_cast<ucs_status_t>(-99)), "UCS_ERR_-99");
  void* none = CARAVAN_UCX_CHECK_PTR(static_cast<ucs_status_ptr_t>(nullptr));
  EXPECT_EQ(none, nullptr);
  CARAVAN_EXPECT_ERROR(CARAVAN_UCX_CHECK_PTR(UCS_STATUS_PTR(UCS_ERR_NO_MEMORY)), Errc::transport, "UCS_ERR_NO_MEMORY");
}

}  // namespace
}  // namespace caravan::net
