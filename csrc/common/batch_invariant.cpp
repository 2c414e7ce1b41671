#include "common/batch_invariant.h"

#include <ATen/Context.h>

#include <atomic>

namespace rl_losses {

namespace {
// Relaxed: the switch orders nothing else; a call reads it once, on the thread that launches the call's work.
std::atomic<bool> enabled_{false};
}  // namespace

bool batch_invariant() {
  return enabled_.load(std::memory_order_relaxed) || at::globalContext().deterministicAlgorithms();
}

bool set_batch_invariant(bool enabled) { return enabled_.exchange(enabled, std::memory_order_relaxed); }

}  // namespace rl_losses
