// Worker: this rank's UCX context, worker, endpoints and progress thread.
//
// Object graph: Worker -> ucp_context (features: AM, RMA, 32/64-bit atomics, wake-up)
//                      -> ucp_worker (UCS_THREAD_MODE_MULTI: any thread may post operations)
//                      -> one ucp_ep per rank (created from the worker addresses exchanged at
//                         the rendezvous; error handling mode per CARAVAN_UCX_ERROR_MODE)
//                      -> the progress thread.
//
// Who progresses the worker: only the progress thread calls ucp_worker_progress. So every
// completion callback and every active-message handler runs on that thread, one at a time; they
// must not block. Other threads post operations (sends, puts, atomics) directly, UCX's worker
// lock serialising them, and call wake() when an operation they posted needs progress to
// finish. That thread also keeps progressing while the rank is otherwise idle, which matters
// over `tcp`: there RMA is emulated with messages that the *target* must progress.
//
// Idle strategy: after the last event the thread polls for CARAVAN_UCX_POLL_US (a reply that
// comes within microseconds is caught without a syscall), then arms the worker's event fd and
// sleeps in epoll until traffic arrives, wake() is called or the next tick is due.
#pragma once

#include "runtime/net/wire.h"

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace caravan::net {

struct AmMessage {
  int source = -1;                    // the sender's rank (as it claims it in the header)
  std::span<const std::byte> body;    // valid during the handler only
  ucp_ep_h reply_ep = nullptr;        // set when the sender asked for replies (bootstrap only)
};
// Runs on the progress thread; must not block. An exception it throws is logged and dropped.
using AmHandler = std::function<void(const AmMessage&)>;

class Worker {
 public:
  struct Options {
    std::string tls;            // UCX_TLS for this context; empty: UCX's default
    int poll_us = 50;
    std::chrono::milliseconds tick{0};  // period of `on_tick`; 0: no tick
    std::function<void()> on_tick;      // runs on the progress thread
    // An endpoint to `rank` reported `status` (on the progress thread).
    std::function<void(int rank, ucs_status_t status)> on_endpoint_error;
  };

  Worker(int rank, Options options);
  ~Worker();  // stop(), then endpoints, worker and context are released
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  int rank() const { return rank_; }
  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }
  std::vector<std::byte> address() const { return address_; }
  std::string transports() const;  // what the context selected, for logs

  // Registers the handler of message `id` (kMessageIdLimit > id > 0). May be called while the
  // progress thread runs; a handler replaced later stays alive until the Worker is destroyed.
  void set_handler(std::uint16_t id, AmHandler handler);

  // Endpoints to ranks, from their worker addresses, with UCP_ERR_HANDLING_MODE_PEER where
  // `peer_error_mode[rank]`. connect_all() happens once, before any message to them;
  // endpoint() is then read without a lock.
  void connect_all(const std::vector<std::vector<std::byte>>& addresses, const std::vector<bool>& peer_error_mode);
  ucp_ep_h endpoint(int rank) const { return rank >= 0 && rank < static_cast<int>(endpoints_.size()) ? endpoints_[rank] : nullptr; }

  // Client/server endpoints for the rendezvous only.
  ucp_ep_h connect_sockaddr(const std::string& host, int port);
  void listen(const std::string& host, int port, std::function<void(ucp_conn_request_h)> on_request);
  ucp_ep_h accept(ucp_conn_request_h request);
  void stop_listening();

  // Sends message `id` with `body` (copied) to `ep`. Returns false, sending nothing, if UCX
  // refused at once (the failure is logged). Delivery is not confirmed: a peer that fails
  // is noticed by the liveness protocol, not by the send.
  bool send(ucp_ep_h ep, std::uint16_t id, std::span<const std::byte> body, bool want_reply = false);

  // Closes `ep` (force: without flushing) and waits at most `timeout` for UCX to finish.
  void close(ucp_ep_h ep, bool force, std::chrono::milliseconds timeout);
  void close_all(const std::vector<bool>& force, std::chrono::milliseconds timeout);

  // Waits for UCX request `request` (from any non-progress thread) at most `timeout`; the
  // progress thread completes it. Returns its status, UCS_ERR_TIMED_OUT if time ran out.
  ucs_status_t wait(void* request, std::chrono::milliseconds timeout);

  void start();
  void stop();
  void wake();
  bool on_progress_thread() const { return std::this_thread::get_id() == thread_id_.load(std::memory_order_relaxed); }

 private:
  struct HandlerSlot {
    Worker* worker = nullptr;
    std::uint16_t id = 0;
    std::atomic<AmHandler*> handler{nullptr};
  };
  struct EndpointSlot {
    Worker* worker = nullptr;
    int rank = -1;
  };

  static ucs_status_t am_callback(void* arg, const void* header, std::size_t header_length, void* data,
                                  std::size_t length, const ucp_am_recv_param_t* param);
  static void endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  void progress_main();

  const int rank_;
  Options options_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int epoll_fd_ = -1;
  std::vector<std::byte> address_;
  std::vector<std::unique_ptr<HandlerSlot>> handlers_;
  std::mutex handler_mutex_;
  std::vector<std::unique_ptr<AmHandler>> retired_handlers_;  // guarded by handler_mutex_
  std::vector<ucp_ep_h> endpoints_;
  std::vector<std::unique_ptr<EndpointSlot>> endpoint_slots_;   // of endpoints_
  std::vector<std::unique_ptr<EndpointSlot>> bootstrap_slots_;  // guarded by handler_mutex_
  ucp_listener_h listener_ = nullptr;
  std::function<void(ucp_conn_request_h)> on_conn_request_;
  std::thread thread_;
  std::atomic<std::thread::id> thread_id_{};
  std::atomic<bool> stop_{false};
};

}  // namespace caravan::net
