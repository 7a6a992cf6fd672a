#include "runtime/net/worker.h"

#include "runtime/cpu_relax.h"
#include "runtime/event_table.h"
#include "runtime/log.h"
#include "runtime/net/ucx.h"

#include <fmt/format.h>

#include <netdb.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace caravan::net {
namespace {

using Clock = std::chrono::steady_clock;

// A message body copied for UCX: it must stay valid until UCX reports the send complete.
// `source` is the 4-byte UCX header every Caravan message carries.
struct SendRecord {
  std::uint32_t source;
  std::vector<std::byte> body;
};

void send_done(void* request, ucs_status_t status, void* user) {
  delete static_cast<SendRecord*>(user);
  if (status != UCS_OK && status != UCS_ERR_CANCELED)
    log::get("net")->debug("active message send completed with {}", ucs_status_name(status));
  ucp_request_free(request);
}

sockaddr_storage resolve_address(const std::string& host, int port, socklen_t* length) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0 || !found)
    throw Error(Errc::invalid_argument,
                fmt::format("MASTER_ADDR={}: cannot resolve it ({})", host, gai_strerror(rc)));
  sockaddr_storage out{};
  std::memcpy(&out, found->ai_addr, found->ai_addrlen);
  *length = found->ai_addrlen;
  freeaddrinfo(found);
  return out;
}

}  // namespace

Worker::Worker(int rank, Options options) : rank_(rank), options_(std::move(options)) {
  ucp_config_t* config = nullptr;
  CARAVAN_UCX_CHECK(ucp_config_read(nullptr, nullptr, &config));
  try {
    if (!options_.tls.empty()) CARAVAN_UCX_CHECK(ucp_config_modify(config, "TLS", options_.tls.c_str()));
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_AMO32 | UCP_FEATURE_AMO64 | UCP_FEATURE_WAKEUP;
    CARAVAN_UCX_CHECK(ucp_init(&params, config, &context_));
  } catch (...) {
    ucp_config_release(config);
    throw;
  }
  ucp_config_release(config);
  try {
    ucp_worker_params_t worker_params{};
    worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    worker_params.thread_mode = UCS_THREAD_MODE_MULTI;
    CARAVAN_UCX_CHECK(ucp_worker_create(context_, &worker_params, &worker_));
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
    CARAVAN_UCX_CHECK(ucp_worker_query(worker_, &attr));
    if (attr.thread_mode != UCS_THREAD_MODE_MULTI)
      throw Error(Errc::transport, "this UCX was built without multi-thread support (--enable-mt); Caravan posts "
                                   "operations from several threads");
    ucp_address_t* address = nullptr;
    std::size_t address_length = 0;
    CARAVAN_UCX_CHECK(ucp_worker_get_address(worker_, &address, &address_length));
    auto* bytes = reinterpret_cast<const std::byte*>(address);
    address_.assign(bytes, bytes + address_length);
    ucp_worker_release_address(worker_, address);

    int event_fd = -1;
    CARAVAN_UCX_CHECK(ucp_worker_get_efd(worker_, &event_fd));
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    if (epoll_fd_ < 0) throw Error(Errc::transport, fmt::format("epoll_create1 failed: {}", std::strerror(errno)));
    epoll_event event{};
    event.events = EPOLLIN;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, event_fd, &event) != 0)
      throw Error(Errc::transport, fmt::format("epoll_ctl(UCX worker fd) failed: {}", std::strerror(errno)));

    handlers_.resize(kMessageIdLimit);
    for (std::uint16_t id = 1; id < kMessageIdLimit; ++id) {
      handlers_[id] = std::make_unique<HandlerSlot>();
      handlers_[id]->worker = this;
      handlers_[id]->id = id;
      ucp_am_handler_param_t handler{};
      handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                           UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
      handler.id = id;
      handler.cb = &Worker::am_callback;
      handler.arg = handlers_[id].get();
      handler.flags = UCP_AM_FLAG_WHOLE_MSG;
      CARAVAN_UCX_CHECK(ucp_worker_set_am_recv_handler(worker_, &handler));
    }
  } catch (...) {
    if (epoll_fd_ >= 0) ::close(epoll_fd_);
    if (worker_) ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    throw;
  }
}

Worker::~Worker() {
  stop();
  for (ucp_ep_h ep : endpoints_)
    if (ep) close(ep, true, std::chrono::milliseconds(100));
  endpoints_.clear();
  stop_listening();
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
  ::close(epoll_fd_);
  for (auto& slot : handlers_)
    if (slot) delete slot->handler.load();
}

std::string Worker::transports() const {
  return options_.tls.empty() ? "UCX's default transports" : "UCX_TLS=" + options_.tls;
}

void Worker::set_handler(std::uint16_t id, AmHandler handler) {
  if (id == 0 || id >= kMessageIdLimit)
    throw Error(Errc::invalid_argument, fmt::format("message id {} is outside [1, {})", id, kMessageIdLimit));
  auto* fresh = new AmHandler(std::move(handler));
  AmHandler* old = handlers_[id]->handler.exchange(fresh, std::memory_order_acq_rel);
  // The progress thread may be running the old handler now; keep it until destruction.
  if (old) {
    std::lock_guard lock(handler_mutex_);
    retired_handlers_.emplace_back(old);
  }
}

ucs_status_t Worker::am_callback(void* arg, const void* header, std::size_t header_length, void* data,
                                 std::size_t length, const ucp_am_recv_param_t* param) {
  auto* slot = static_cast<HandlerSlot*>(arg);
  auto logger = log::get("net");
  if (header_length != sizeof(std::uint32_t)) {
    logger->error("dropped message {} with a {}-byte header (expected 4)", message_name(slot->id), header_length);
    return UCS_OK;
  }
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    // Every Caravan message is sent with UCP_AM_SEND_FLAG_EAGER, so this is a foreign sender.
    logger->error("dropped message {}: rendezvous data is not expected", message_name(slot->id));
    return UCS_OK;
  }
  AmMessage message;
  std::uint32_t source = 0;
  std::memcpy(&source, header, sizeof(source));
  message.source = static_cast<int>(source);
  message.body = std::span<const std::byte>(static_cast<const std::byte*>(data), length);
  if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) message.reply_ep = param->reply_ep;
  AmHandler* handler = slot->handler.load(std::memory_order_acquire);
  if (!handler) {
    logger->warn("dropped message {} from rank {}: no handler registered", message_name(slot->id), message.source);
    return UCS_OK;
  }
  try {
    (*handler)(message);
  } catch (const std::exception& e) {
    logger->error("handler of message {} from rank {} failed: {}", message_name(slot->id), message.source, e.what());
  }
  return UCS_OK;
}

void Worker::endpoint_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* slot = static_cast<EndpointSlot*>(arg);
  if (slot->worker->options_.on_endpoint_error) slot->worker->options_.on_endpoint_error(slot->rank, status);
  (void)ep;
}

void Worker::connect_all(const std::vector<std::vector<std::byte>>& addresses, const std::vector<bool>& peer_error_mode) {
  endpoints_.assign(addresses.size(), nullptr);
  endpoint_slots_.resize(addresses.size());
  for (std::size_t r = 0; r < addresses.size(); ++r) {
    endpoint_slots_[r] = std::make_unique<EndpointSlot>();
    endpoint_slots_[r]->worker = this;
    endpoint_slots_[r]->rank = static_cast<int>(r);
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(addresses[r].data());
    // See Network::error_modes for the trade-off.
    params.err_mode = peer_error_mode[r] ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    params.err_handler.cb = &Worker::endpoint_error;
    params.err_handler.arg = endpoint_slots_[r].get();
    CARAVAN_UCX_CHECK(ucp_ep_create(worker_, &params, &endpoints_[r]));
  }
}

ucp_ep_h Worker::connect_sockaddr(const std::string& host, int port) {
  socklen_t length = 0;
  sockaddr_storage address = resolve_address(host, port, &length);
  auto slot = std::make_unique<EndpointSlot>();
  slot->worker = this;
  slot->rank = -1;  // the rendezvous endpoint: errors mean "rank 0 not reachable (yet)"
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address);
  params.sockaddr.addrlen = length;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Worker::endpoint_error;
  params.err_handler.arg = slot.get();
  ucp_ep_h ep = nullptr;
  CARAVAN_UCX_CHECK(ucp_ep_create(worker_, &params, &ep));
  std::lock_guard lock(handler_mutex_);
  bootstrap_slots_.push_back(std::move(slot));
  return ep;
}

void Worker::listen(const std::string& host, int port, std::function<void(ucp_conn_request_h)> on_request) {
  socklen_t length = 0;
  sockaddr_storage address = resolve_address(host, port, &length);
  on_conn_request_ = std::move(on_request);
  ucp_listener_params_t params{};
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&address);
  params.sockaddr.addrlen = length;
  params.conn_handler.cb = [](ucp_conn_request_h request, void* arg) {
    static_cast<Worker*>(arg)->on_conn_request_(request);
  };
  params.conn_handler.arg = this;
  CARAVAN_UCX_CHECK(ucp_listener_create(worker_, &params, &listener_));
}

ucp_ep_h Worker::accept(ucp_conn_request_h request) {
  auto slot = std::make_unique<EndpointSlot>();
  slot->worker = this;
  slot->rank = -2;  // a rendezvous endpoint on rank 0; its errors only mean a joiner went away
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.conn_request = request;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Worker::endpoint_error;
  params.err_handler.arg = slot.get();
  ucp_ep_h ep = nullptr;
  CARAVAN_UCX_CHECK(ucp_ep_create(worker_, &params, &ep));
  std::lock_guard lock(handler_mutex_);
  bootstrap_slots_.push_back(std::move(slot));
  return ep;
}

void Worker::stop_listening() {
  if (listener_) ucp_listener_destroy(listener_);
  listener_ = nullptr;
}

bool Worker::send(ucp_ep_h ep, std::uint16_t id, std::span<const std::byte> body, bool want_reply) {
  if (!ep) return false;
  auto* record = new SendRecord{static_cast<std::uint32_t>(rank_), {body.begin(), body.end()}};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  // Eager always: control messages are small, and a handler then always has the whole
  // message at once (no rendezvous receive to drive from inside a callback).
  param.flags = UCP_AM_SEND_FLAG_EAGER | (want_reply ? UCP_AM_SEND_FLAG_REPLY : 0);
  param.cb.send = &send_done;
  param.user_data = record;
  ucs_status_ptr_t request = ucp_am_send_nbx(ep, id, &record->source, sizeof(record->source), record->body.data(),
                                             record->body.size(), &param);
  if (request == nullptr) {
    delete record;
    return true;
  }
  if (UCS_PTR_IS_ERR(request)) {
    log::get("net")->debug("ucp_am_send_nbx({}) failed: {}", message_name(id), ucs_status_name(UCS_PTR_STATUS(request)));
    delete record;
    return false;
  }
  if (!on_progress_thread()) wake();
  return true;
}

ucs_status_t Worker::wait(void* request, std::chrono::milliseconds timeout) {
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  auto deadline = Clock::now() + timeout;
  bool progressing = thread_.joinable() && !on_progress_thread();
  for (;;) {
    ucs_status_t status = ucp_request_check_status(request);
    if (status != UCS_INPROGRESS) {
      ucp_request_free(request);
      return status;
    }
    if (Clock::now() >= deadline) {
      ucp_request_cancel(worker_, request);
      ucp_request_free(request);  // UCX releases it when the cancellation completes
      return UCS_ERR_TIMED_OUT;
    }
    if (progressing) {
      wake();
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    } else {
      ucp_worker_progress(worker_);
    }
  }
}

void Worker::close(ucp_ep_h ep, bool force, std::chrono::milliseconds timeout) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* request = ucp_ep_close_nbx(ep, &param);
  ucs_status_t status = wait(request, timeout);
  if (status != UCS_OK && status != UCS_ERR_CANCELED && status != UCS_ERR_ENDPOINT_TIMEOUT &&
      status != UCS_ERR_CONNECTION_RESET && status != UCS_ERR_NOT_CONNECTED)
    log::get("net")->debug("closing an endpoint ended with {}", ucs_status_name(status));
}

void Worker::close_all(const std::vector<bool>& force, std::chrono::milliseconds timeout) {
  // Start every close first, then wait: the peers' closes proceed in parallel.
  std::vector<void*> requests;
  for (std::size_t r = 0; r < endpoints_.size(); ++r) {
    if (!endpoints_[r]) continue;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = r < force.size() && force[r] ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    requests.push_back(ucp_ep_close_nbx(endpoints_[r], &param));
    endpoints_[r] = nullptr;
  }
  auto deadline = Clock::now() + timeout;
  for (void* request : requests) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    wait(request, std::max(left, std::chrono::milliseconds(1)));
  }
}

void Worker::start() {
  if (thread_.joinable()) return;
  stop_.store(false, std::memory_order_release);
  thread_ = std::thread([this] { progress_main(); });
}

void Worker::stop() {
  if (!thread_.joinable()) return;
  stop_.store(true, std::memory_order_release);
  wake();
  thread_.join();
  thread_id_.store(std::thread::id(), std::memory_order_relaxed);
}

void Worker::wake() { ucp_worker_signal(worker_); }

void Worker::progress_main() {
  const detail::RuntimeThreadRole role("the network's progress thread");
  detail::t_on_progress_thread = true;  // for the whole life of this thread
  thread_id_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  const auto poll = std::chrono::microseconds(options_.poll_us);
  const auto tick = options_.tick;
  auto next_tick = Clock::now() + tick;
  auto last_event = Clock::now();
  unsigned idle_spins = 0;
  bool arm_failed_logged = false;
  while (!stop_.load(std::memory_order_acquire)) {
    unsigned events = ucp_worker_progress(worker_);
    auto now = Clock::now();
    if (tick.count() > 0 && now >= next_tick) {
      if (options_.on_tick) {
        try {
          options_.on_tick();
        } catch (const std::exception& e) {
          log::get("net")->error("progress tick failed: {}", e.what());
        }
      }
      next_tick = now + tick;
    }
    if (events) {
      last_event = now;
      idle_spins = 0;
      continue;
    }
    if (now - last_event < poll) {
      // Poll: yield now and then so that a rank's worker threads get the core on small machines.
      if (++idle_spins % 64 == 0) std::this_thread::yield();
      else cpu_relax();
      continue;
    }
    // Sleep until the worker's fd fires (traffic or wake()) or the next tick is due. arm()
    // returns BUSY if events arrived since the last progress: progress them first.
    ucs_status_t status = ucp_worker_arm(worker_);
    if (status == UCS_ERR_BUSY) continue;
    int timeout_ms = 100;
    if (tick.count() > 0)
      timeout_ms = static_cast<int>(std::max<std::int64_t>(
          0, std::chrono::duration_cast<std::chrono::milliseconds>(next_tick - now).count() + 1));
    if (status != UCS_OK) {
      if (!arm_failed_logged) log::get("net")->warn("ucp_worker_arm failed ({}); polling", ucs_status_name(status));
      arm_failed_logged = true;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    } else {
      epoll_event event{};
      epoll_wait(epoll_fd_, &event, 1, timeout_ms);
    }
    last_event = Clock::now();
  }
}

}  // namespace caravan::net
