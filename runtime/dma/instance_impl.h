#pragma once

#include "runtime/dma/storage.h"

#include <caravan/copy.h>

#include <memory>
#include <vector>

namespace caravan {

// What an Instance handle points to. Fields come before the linearization, which keeps a
// pointer to them; the object never moves (it lives in a shared_ptr).
class InstanceImpl {
 public:
  InstanceImpl(MemoryId memory_id, IndexSpace index_space, FieldSpace field_space, Layout instance_layout)
      : memory(memory_id),
        space(std::move(index_space)),
        fields(std::move(field_space)),
        layout(instance_layout),
        lin(layout, space, fields) {}
  InstanceImpl(const InstanceImpl&) = delete;
  InstanceImpl& operator=(const InstanceImpl&) = delete;

  MemoryId memory;
  IndexSpace space;
  FieldSpace fields;
  Layout layout;
  Linearization lin;
  std::shared_ptr<dma::Storage> storage;  // null for another rank's instance
  // Cross-rank copies: the owner numbers the instances it exported (0: never); another rank's
  // Instance (from_descriptor) keeps the descriptor it came from and has no storage.
  std::uint64_t export_id = 0;
  bool remote = false;
  std::vector<std::byte> descriptor;
  // Another rank's GPU memory: what its descriptor carries for mapping it through IPC (the form
  // of a hop target, Engine::export_target), or empty.
  std::vector<std::byte> gpu_target;
};

}  // namespace caravan
