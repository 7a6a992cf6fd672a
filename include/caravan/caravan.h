// Everything a Caravan application needs.
#pragma once

#include <caravan/copy.h>  // instances and copies (link caravan::dma)
#include <caravan/error.h>
#include <caravan/event.h>
#include <caravan/platform.h>
#include <caravan/runtime.h>
#include <caravan/settings.h>
#include <caravan/symmetric_heap.h>
#include <caravan/task.h>
#include <caravan/task_graph.h>
