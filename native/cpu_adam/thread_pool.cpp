#include "thread_pool.h"

#include <unistd.h>

#include <thread>

namespace infinity_adam {

ThreadPool& ThreadPool::instance() {
  // Note: pools are never destroyed. Workers are detached and sleep on a condition
  // variable, so exit needs no join, and a child after fork() simply abandons the
  // parent's pool (its threads were not copied) and builds its own.
  static std::mutex mu;
  static ThreadPool* pool = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mu);
  if (pool == nullptr || owner != getpid()) {
    pool = new ThreadPool();
    owner = getpid();
  }
  return *pool;
}

void ThreadPool::grow(int workers) {
  std::lock_guard<std::mutex> lock(mu_);
  for (; workers_ < workers; ++workers_) {
    // The worker starts from the current generation, read under the lock, so a job
    // published right after grow() returns is never missed.
    std::thread(&ThreadPool::worker_loop, this, workers_ + 1, generation_).detach();
  }
}

void ThreadPool::worker_loop(int index, uint64_t seen) {
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (index >= active_) continue;
      job = job_;
    }
    (*job)(index);
    std::lock_guard<std::mutex> lock(mu_);
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

void ThreadPool::run(int n, const std::function<void(int)>& fn) {
  if (n <= 1) {
    fn(0);
    return;
  }
  std::lock_guard<std::mutex> serial(run_mu_);
  grow(n - 1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    active_ = n;
    pending_ = n - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  fn(0);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
}

}  // namespace infinity_adam
