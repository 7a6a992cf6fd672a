#include "runtime/net/wire.h"

#include <fmt/format.h>

#include <limits>

namespace caravan::net {

std::string_view message_name(std::uint16_t id) {
  switch (static_cast<MsgId>(id)) {
    case MsgId::hello: return "hello";
    case MsgId::welcome: return "welcome";
    case MsgId::gather_part: return "gather_part";
    case MsgId::gather_result: return "gather_result";
    case MsgId::heartbeat: return "heartbeat";
    case MsgId::bye: return "bye";
    case MsgId::subscribe: return "subscribe";
    case MsgId::notify: return "notify";
    case MsgId::trigger: return "trigger";
    case MsgId::spawn: return "spawn";
    case MsgId::spawn_done: return "spawn_done";
    case MsgId::heap_signal: return "heap_signal";
  }
  return id >= kFirstUserMessage && id < kMessageIdLimit ? "user" : "unknown";
}

WireWriter& WireWriter::put_bytes(std::span<const std::byte> bytes) {
  // The length travels in 32 bits; a longer field would be cut and the message misread.
  if (bytes.size() > std::numeric_limits<std::uint32_t>::max())
    throw Error(Errc::invalid_argument,
                fmt::format("a message field of {} bytes: at most 4 GiB - 1 travel in one field", bytes.size()));
  put(static_cast<std::uint32_t>(bytes.size()));
  bytes_.insert(bytes_.end(), bytes.begin(), bytes.end());
  return *this;
}

WireWriter& WireWriter::put_string(std::string_view text) {
  return put_bytes(std::as_bytes(std::span<const char>(text.data(), text.size())));
}

WireWriter& WireWriter::put_failure(const FailureCause& failure) {
  put(static_cast<std::uint8_t>(failure ? 1 : 0));
  if (failure) {
    put(static_cast<std::uint8_t>(failure->code()));
    put_string(failure->what());
  }
  return *this;
}

std::span<const std::byte> WireReader::take(std::size_t n) {
  if (n > bytes_.size() - pos_)
    throw Error(Errc::internal, fmt::format("malformed {}: needs {} more bytes at offset {}, has {}", what_, n, pos_,
                                            bytes_.size() - pos_));
  auto out = bytes_.subspan(pos_, n);
  pos_ += n;
  return out;
}

std::span<const std::byte> WireReader::get_bytes() { return take(get<std::uint32_t>()); }

std::string WireReader::get_string() {
  auto bytes = get_bytes();
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

FailureCause WireReader::get_failure() {
  if (get<std::uint8_t>() == 0) return nullptr;
  auto code = get<std::uint8_t>();
  if (code > static_cast<std::uint8_t>(Errc::internal))
    throw Error(Errc::internal, fmt::format("malformed {}: error code {} is unknown", what_, code));
  return make_failure(static_cast<Errc>(code), get_string());
}

void WireReader::expect_end() const {
  if (pos_ != bytes_.size())
    throw Error(Errc::internal, fmt::format("malformed {}: {} bytes left over", what_, bytes_.size() - pos_));
}

}  // namespace caravan::net
