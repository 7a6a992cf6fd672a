// The launcher behind `caravan run`: starts N ranks of one program as local processes.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace caravan::app {

struct RunSpec {
  int ranks = 1;
  int nodes = 1;                       // logical nodes: ranks are split into K contiguous blocks
  std::string address = "127.0.0.1";  // MASTER_ADDR: where rank 0 listens for the rendezvous
  int port = 0;                        // MASTER_PORT; 0: a free port of `address`
  double grace_s = -1;                 // after a rank fails, how long the others may run on; <0: default
  std::vector<std::string> command;    // program and arguments
  std::vector<std::pair<std::string, std::string>> environment;  // extra variables for every rank
  bool quiet = false;                  // no summary line when every rank succeeds
};

// Starts the ranks (fork + exec: the launcher never initialises UCX or a GPU, though UCX, linked
// in, installs a SIGHUP handler, which is why SIGHUP is waited for too), waits for
// them, reports each rank that fails, and returns the exit status for the tool: 0 when every
// rank exited 0, else the first failed rank's status (128 + signal for a signal). Throws
// caravan::Error(invalid_argument) for a bad spec.
int run_ranks(const RunSpec& spec);

// A TCP port free on `address` now, drawn below the kernel's ephemeral port range.
int free_port(const std::string& address);

}  // namespace caravan::app
