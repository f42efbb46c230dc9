// A small persistent pool of std::threads for the optimizer step. Not OpenMP on purpose:
// torch's wheel ships its own libgomp, and two OpenMP runtimes in one process fight over
// threads and affinity.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

namespace infinity_adam {

class ThreadPool {
 public:
  // Runs fn(0..n-1) concurrently, fn(0) on the calling thread, and returns when all are
  // done. Calls from several threads are serialized.
  void run(int n, const std::function<void(int)>& fn);

  // The process-wide pool. A forked child gets a fresh one: the parent's workers do
  // not exist there.
  static ThreadPool& instance();

 private:
  void grow(int workers);
  void worker_loop(int index, uint64_t seen);

  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;      // guards everything below
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  int workers_ = 0;
  uint64_t generation_ = 0;
  int active_ = 0;   // workers 1..active_-1 take part in the current job
  int pending_ = 0;  // participants not yet finished
  const std::function<void(int)>* job_ = nullptr;
};

}  // namespace infinity_adam
