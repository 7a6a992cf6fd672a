#pragma once

#include "runtime/dma/storage.h"

#include <caravan/copy.h>

#include <memory>

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
  std::shared_ptr<dma::Storage> storage;
};

}  // namespace caravan
