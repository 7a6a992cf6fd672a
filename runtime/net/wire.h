// The messages ranks exchange, and how their bodies are encoded.
//
// Every active message carries a 4-byte UCX header (the sender's rank, so that a handler knows
// who spoke without a lookup by endpoint) and a body built with WireWriter. Bodies are plain
// little-endian bytes of trivially copyable fields: every rank runs the same binary on the same
// architecture (a job is one build), so no byte swapping is needed; the reader still checks
// every length, so a truncated or corrupt message is an error, not a wild read.
// docs/distributed.md lists each message and why it exists.
#pragma once

#include <caravan/error.h>
#include <caravan/event.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace caravan::net {

enum class MsgId : std::uint16_t {
  // Bootstrap (over the rendezvous endpoints to rank 0).
  hello = 1,    // rank -> 0: my rank, node key, host, pid, worker address
  welcome,      // 0 -> rank: the table of all ranks (or the reason the job cannot start)
  // Collectives (allgather through rank 0; a barrier is an allgather of nothing).
  gather_part,    // rank -> 0: my contribution to collective number `seq`
  gather_result,  // 0 -> rank: everyone's contributions to `seq`
  // Liveness.
  heartbeat,  // rank -> peer, every CARAVAN_HEARTBEAT_MS: I am alive
  bye,        // rank -> peer: I have shut down; do not expect me any more
  // Distributed events and tasks.
  subscribe,   // rank -> owner: tell me when your event E triggers
  notify,      // owner -> subscriber: E triggered (or was poisoned, with the cause)
  trigger,     // rank -> owner: trigger (or poison) your user event E
  spawn,       // rank -> target: run task NAME after PRECONDITION; report to COMPLETION
  spawn_done,  // target -> spawner: the task behind COMPLETION finished (or failed)
  // Host symmetric heap.
  heap_signal,  // rank -> owner: apply a signal op to my flag in your heap (no UCX atomics path)
};
// Ids from kFirstUserMessage on are free for other subsystems (the DMA engine's nic channel
// uses them for XD progress between ranks); ids are below kMessageIdLimit.
inline constexpr std::uint16_t kFirstUserMessage = 32;
inline constexpr std::uint16_t kMessageIdLimit = 64;

std::string_view message_name(std::uint16_t id);

class WireWriter {
 public:
  template <class T>
  WireWriter& put(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>, "wire fields are raw bytes");
    auto at = bytes_.size();
    bytes_.resize(at + sizeof(T));
    std::memcpy(bytes_.data() + at, &value, sizeof(T));
    return *this;
  }
  WireWriter& put_bytes(std::span<const std::byte> bytes);  // length-prefixed
  WireWriter& put_string(std::string_view text);            // length-prefixed
  WireWriter& put_failure(const FailureCause& failure);     // (present, code, message)
  std::span<const std::byte> bytes() const { return bytes_; }
  std::vector<std::byte> take() { return std::move(bytes_); }

 private:
  std::vector<std::byte> bytes_;
};

class WireReader {
 public:
  // `what` names the message in errors ("subscribe from rank 2").
  WireReader(std::span<const std::byte> bytes, std::string what) : bytes_(bytes), what_(std::move(what)) {}
  template <class T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>, "wire fields are raw bytes");
    T value;
    std::memcpy(&value, take(sizeof(T)).data(), sizeof(T));
    return value;
  }
  std::span<const std::byte> get_bytes();
  std::string get_string();
  FailureCause get_failure();
  bool at_end() const { return pos_ == bytes_.size(); }
  // Throws Error(internal) if bytes are left over (a message of the wrong shape).
  void expect_end() const;

 private:
  std::span<const std::byte> take(std::size_t n);
  std::span<const std::byte> bytes_;
  std::size_t pos_ = 0;
  std::string what_;
};

}  // namespace caravan::net
