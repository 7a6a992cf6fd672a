// Device-side symmetric-memory API: what a kernel running on one GPU of the heap uses to reach
// the same allocation on the other GPUs (the primitive lists of Iris and Triton-distributed).
//
// Every GPU ("rank") of a GpuSymmetricHeap holds one heap of the same size; an allocation has
// the same offset in each. A kernel gets a HeapView (by value) whose bases table holds each
// rank's heap base as mapped on this GPU, so reaching rank p's copy of a local pointer is one
// subtraction and one addition: translate().
//
// Memory orders and scopes follow the C++/CUDA model: a release operation at system scope
// makes this thread's earlier writes (to any GPU's memory) visible to whoever acquires the
// value it wrote; gpu scope only orders against threads of the same GPU; block scope against
// the block. Copy engines and stream memory operations order with these at system scope.
#pragma once

#include "kernels/gpu/device.cuh"
#include "kernels/gpu/heap_view.h"

#if !defined(CARAVAN_GPU_AMD)
#include <cuda/atomic>
#endif

#include <cstdint>

namespace caravan::gpu::dev {

enum class Order { relaxed, acquire, release, acq_rel, seq_cst };
enum class Scope { block, gpu, system };

template <class T>
__device__ inline T* translate(const HeapView& heap, T* local, int rank) {
  const auto offset = reinterpret_cast<const char*>(local) - heap.bases[heap.rank];
  return reinterpret_cast<T*>(heap.bases[rank] + offset);
}

namespace detail {
// One atomic access of `*p` with an order and scope: libcu++'s atomic_ref on NVIDIA, clang's
// HIP atomic builtins on AMD (their scopes: workgroup, agent, system).
#if defined(CARAVAN_GPU_AMD)
template <Scope S>
constexpr int scope_of() {
  return S == Scope::block ? __HIP_MEMORY_SCOPE_WORKGROUP
                           : (S == Scope::gpu ? __HIP_MEMORY_SCOPE_AGENT : __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ constexpr int order_of(Order o) {
  switch (o) {
    case Order::relaxed: return __ATOMIC_RELAXED;
    case Order::acquire: return __ATOMIC_ACQUIRE;
    case Order::release: return __ATOMIC_RELEASE;
    case Order::acq_rel: return __ATOMIC_ACQ_REL;
    default: return __ATOMIC_SEQ_CST;
  }
}
// A failed compare-exchange only loads: the strongest load order the requested order implies.
__device__ constexpr int failure_order_of(Order o) {
  return o == Order::seq_cst ? __ATOMIC_SEQ_CST
                             : (o == Order::acquire || o == Order::acq_rel ? __ATOMIC_ACQUIRE : __ATOMIC_RELAXED);
}
template <Scope S, class T>
__device__ inline T load(T* p, Order o) {
  return __hip_atomic_load(p, order_of(o), scope_of<S>());
}
template <Scope S, class T>
__device__ inline void store(T* p, T v, Order o) {
  __hip_atomic_store(p, v, order_of(o), scope_of<S>());
}
template <Scope S, class T>
__device__ inline T fetch_add(T* p, T v, Order o) {
  return __hip_atomic_fetch_add(p, v, order_of(o), scope_of<S>());
}
template <Scope S, class T>
__device__ inline T exchange(T* p, T v, Order o) {
  return __hip_atomic_exchange(p, v, order_of(o), scope_of<S>());
}
template <Scope S, class T>
__device__ inline T compare_exchange(T* p, T expected, T desired, Order o) {
  __hip_atomic_compare_exchange_strong(p, &expected, desired, order_of(o), failure_order_of(o), scope_of<S>());
  return expected;
}
#else
template <Scope S>
struct ScopeOf;
template <>
struct ScopeOf<Scope::block> {
  static constexpr cuda::thread_scope value = cuda::thread_scope_block;
};
template <>
struct ScopeOf<Scope::gpu> {
  static constexpr cuda::thread_scope value = cuda::thread_scope_device;
};
template <>
struct ScopeOf<Scope::system> {
  static constexpr cuda::thread_scope value = cuda::thread_scope_system;
};
__device__ constexpr cuda::memory_order to_cuda(Order o) {
  switch (o) {
    case Order::relaxed: return cuda::memory_order_relaxed;
    case Order::acquire: return cuda::memory_order_acquire;
    case Order::release: return cuda::memory_order_release;
    case Order::acq_rel: return cuda::memory_order_acq_rel;
    default: return cuda::memory_order_seq_cst;
  }
}
template <Scope S, class T>
__device__ inline T load(T* p, Order o) {
  return cuda::atomic_ref<T, ScopeOf<S>::value>(*p).load(to_cuda(o));
}
template <Scope S, class T>
__device__ inline void store(T* p, T v, Order o) {
  cuda::atomic_ref<T, ScopeOf<S>::value>(*p).store(v, to_cuda(o));
}
template <Scope S, class T>
__device__ inline T fetch_add(T* p, T v, Order o) {
  return cuda::atomic_ref<T, ScopeOf<S>::value>(*p).fetch_add(v, to_cuda(o));
}
template <Scope S, class T>
__device__ inline T exchange(T* p, T v, Order o) {
  return cuda::atomic_ref<T, ScopeOf<S>::value>(*p).exchange(v, to_cuda(o));
}
template <Scope S, class T>
__device__ inline T compare_exchange(T* p, T expected, T desired, Order o) {
  cuda::atomic_ref<T, ScopeOf<S>::value>(*p).compare_exchange_strong(expected, desired, to_cuda(o));
  return expected;
}
#endif
}  // namespace detail

// Atomics on rank `rank`'s copy of `local` (rank == heap.rank for this GPU's own copy).
template <Scope S = Scope::system, class T>
__device__ inline T atomic_load(const HeapView& heap, T* local, int rank, Order order = Order::acquire) {
  return detail::load<S>(translate(heap, local, rank), order);
}
template <Scope S = Scope::system, class T>
__device__ inline void atomic_store(const HeapView& heap, T* local, T value, int rank, Order order = Order::release) {
  detail::store<S>(translate(heap, local, rank), value, order);
}
template <Scope S = Scope::system, class T>
__device__ inline T atomic_add(const HeapView& heap, T* local, T value, int rank, Order order = Order::acq_rel) {
  return detail::fetch_add<S>(translate(heap, local, rank), value, order);
}
template <Scope S = Scope::system, class T>
__device__ inline T atomic_exchange(const HeapView& heap, T* local, T value, int rank, Order order = Order::acq_rel) {
  return detail::exchange<S>(translate(heap, local, rank), value, order);
}
template <Scope S = Scope::system, class T>
__device__ inline T atomic_cas(const HeapView& heap, T* local, T expected, T desired, int rank,
                               Order order = Order::acq_rel) {
  return detail::compare_exchange<S>(translate(heap, local, rank), expected, desired, order);
}

// Signals: 64-bit flags. notify() sets or adds with release (the data written before it is
// visible to the waiter); wait_until() spins with acquire loads until the comparison holds.
enum class SignalOp { set, add };
enum class Compare { eq, ne, ge, gt };

__device__ inline void notify(const HeapView& heap, std::uint64_t* flag, std::uint64_t value, int rank,
                              SignalOp op = SignalOp::set, Order order = Order::release) {
  if (op == SignalOp::set) atomic_store(heap, flag, value, rank, order);
  else atomic_add(heap, flag, value, rank, order);
}

__device__ inline bool compare(std::uint64_t have, Compare cmp, std::uint64_t want) {
  switch (cmp) {
    case Compare::eq: return have == want;
    case Compare::ne: return have != want;
    case Compare::ge: return static_cast<std::int64_t>(have - want) >= 0;  // epochs wrap safely
    default: return static_cast<std::int64_t>(have - want) > 0;
  }
}

// Waits on this GPU's own flag word (signals land in the waiter's memory).
__device__ inline std::uint64_t wait_until(std::uint64_t* flag, Compare cmp, std::uint64_t value,
                                           Order order = Order::acquire) {
  std::uint64_t have = detail::load<Scope::system>(flag, order);
  while (!compare(have, cmp, value)) {
    pause_ns(32);
    have = detail::load<Scope::system>(flag, order);
  }
  return have;
}

// Block-cooperative copies between this GPU and rank `rank`'s copy of a heap allocation,
// 16 bytes per thread access where alignment allows. put() writes `bytes` from local `src` to
// rank's copy of `dst`; get() reads rank's copy of `src` into local `dst`. Neither orders
// anything: follow with notify() (release) to publish, as one thread after __syncthreads().
__device__ inline void copy_block(void* dst, const void* src, std::size_t bytes) {
  const auto d = reinterpret_cast<std::uintptr_t>(dst), s = reinterpret_cast<std::uintptr_t>(src);
  std::size_t done = 0;
  if (((d | s) & 15) == 0) {
    const std::size_t vectors = bytes / 16;
    auto* dv = reinterpret_cast<uint4*>(dst);
    const auto* sv = reinterpret_cast<const uint4*>(src);
    for (std::size_t i = threadIdx.x; i < vectors; i += blockDim.x) dv[i] = sv[i];
    done = vectors * 16;
  }
  auto* db = reinterpret_cast<unsigned char*>(dst);
  const auto* sb = reinterpret_cast<const unsigned char*>(src);
  for (std::size_t i = done + threadIdx.x; i < bytes; i += blockDim.x) db[i] = sb[i];
}
__device__ inline void put(const HeapView& heap, void* dst, const void* src, std::size_t bytes, int rank) {
  copy_block(translate(heap, dst, rank), src, bytes);
}
__device__ inline void get(const HeapView& heap, void* dst, const void* src, std::size_t bytes, int rank) {
  copy_block(dst, translate(heap, const_cast<void*>(src), rank), bytes);
}

}  // namespace caravan::gpu::dev
