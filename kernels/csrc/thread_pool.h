// The threads our kernels split their work over: ringserve::parallel_for, at::parallel_for's
// contract (same chunks, same inline cases) on a pool whose threads spin between calls
// while this process has the CPUs to itself and sleep at once while another process wants
// them.
//
// Why not ATen's OpenMP threads: libgomp fixes how its threads wait when it loads
// (OMP_WAIT_POLICY / GOMP_SPINCOUNT), and a decode step is ~150 parallel regions a few
// tens of microseconds apart. Threads that sleep between them (engine/__init__.py sets
// PASSIVE) pay a wake-up each, 8-9 ms of a 26 ms step at 8 rows on a 2-core VM; threads
// that spin make a busy neighbour's time slices collide with ours, and a step took 2-12x as
// long beside one `while True: pass` (docs/benchmarks.md, "OpenMP waiting"). So these
// threads choose per call: the calling thread samples the machine's runnable tasks
// (/proc/loadavg) every few milliseconds; while nobody but us is runnable the pool's
// threads spin up to kSpinNs between calls, else they sleep on a condition variable.
//
// Where libgomp's own threads spin (torch loaded without OMP_WAIT_POLICY=PASSIVE, or a
// policy of the user's), two pools spinning on the same CPUs would take turns: there
// kernels/cpu_build.py turns the pool off (use_kernel_pool) and the kernels run on
// at::parallel_for, as before. RINGSERVE_KERNEL_SPIN=always or =never fixes the choice (benchmarks, tests); the default
// is auto. One job at a time (a mutex); a call from inside a job, from inside an OpenMP region or
// with one thread runs inline, as at::parallel_for does. Chunks are claimed by whoever
// runs, not dealt out: a worker still waking (or descheduled) when the caller has ended its
// chunk leaves its chunk to the caller; the chunks are the same either way. The first exception a chunk
// throws is rethrown to the caller once every chunk has ended. After fork() the child
// starts a new pool (the parent's threads do not exist there).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RINGSERVE_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define RINGSERVE_RELAX() asm volatile("yield")
#else
#define RINGSERVE_RELAX() std::this_thread::yield()
#endif

#ifndef RINGSERVE_NS
#define RINGSERVE_NS ringserve
#endif

namespace ringserve {
namespace RINGSERVE_NS {  // one pool per kernel variant's library

// How long a thread spins for the next call before it sleeps, while uncontended: the gaps
// inside a decode step are ~10-100 us; the gap between steps (sampling, scheduling) is
// longer, and sleeping there costs one wake-up a step.
constexpr int64_t kSpinNs = 200000;
// How often the calling thread looks at the machine's runnable tasks.
constexpr int64_t kSampleNs = 5000000;
// The share of recent samples that found another process runnable, smoothed over ~10
// samples (50 ms): spinning stops above kStopSpin and starts again below kSpinAgain. A
// CPU-bound neighbour is runnable at every sample (it stops the spinning within ~0.1 s);
// the API process and a load generator beside a served engine are runnable now and then
// (a 32-stream load: median 0.08, peaks 0.5 with a faster average, which stopped the
// spinning in bursts and took a served 32-row step from 74-76 ms to 80-90).
constexpr double kEma = 0.1, kStopSpin = 0.85, kSpinAgain = 0.5;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Runnable tasks on the machine now: the fourth field of /proc/loadavg ("2/150"), or -1.
inline int runnable_tasks() {
  FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return -1;
  double a, b, c;
  int running = -1, total;
  if (std::fscanf(f, "%lf %lf %lf %d/%d", &a, &b, &c, &running, &total) != 5) running = -1;
  std::fclose(f);
  return running;
}

inline int usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
#endif
  return static_cast<int>(std::thread::hardware_concurrency());
}

// Whether parallel_for runs on the pool (else on at::parallel_for).
inline std::atomic<bool>& pool_enabled() {
  static std::atomic<bool> on{true};
  return on;
}

class Pool {
 public:
  // The pool of this process (a new one after fork).
  static Pool& get() {
    static std::once_flag once;
    std::call_once(once, [] {
      pthread_atfork(nullptr, nullptr, [] { instance().store(nullptr); });
    });
    Pool* p = instance().load(std::memory_order_acquire);
    if (p == nullptr) {  // the first call (of this process): two threads may race here
      Pool* fresh = new Pool();  // NOTE: never deleted: its threads outlive main()
      if (instance().compare_exchange_strong(p, fresh, std::memory_order_acq_rel))
        p = fresh;
      else
        delete fresh;  // the other thread's won; this one has started no threads
    }
    return *p;
  }

  bool in_job() const { return tls_in_job(); }

  template <typename F>
  void run(int64_t begin, int64_t end, int64_t grain, const F& f) {
    std::lock_guard<std::mutex> submit(submit_);
    const int threads = at::get_num_threads();
    if (threads != static_cast<int>(workers_.size()) + 1) resize(threads);
    const int64_t tasks = std::min<int64_t>(threads, (end - begin + grain - 1) / grain);
    const int64_t chunk = (end - begin + tasks - 1) / tasks;
    sample();
    ++jobs_;
    fn_ = [&f](int64_t b, int64_t e) { f(b, e); };
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    error_ = nullptr;
    finished_.store(0, std::memory_order_relaxed);
    const uint64_t e = epoch_.load(std::memory_order_relaxed) + 1;
    // The job's chunks are claimed, not assigned: whoever is running takes the next one, so
    // a worker still waking (or descheduled by another process) when the caller has ended
    // its chunk costs the caller one more chunk, not the wait for that worker. The chunks
    // themselves (and so every kernel's sums) are the same whoever runs them.
    // Measured (gemma-3-270m, 8-row steps, 2 Zen 4 cores, builds alternating, 2 rounds of 40
    // steps): threads that sleep (RINGSERVE_KERNEL_SPIN=never) fastest step 28.7 / 29.5 ms
    // against 32.7 / 32.8 dealt out, medians 37.2 / 30.9 against 35.3 / 37.3; served at
    // concurrency 32, 261 / 312 against 284 / 265 tok/s: within the host's noise.
    claim_.store(claim_word(e, tasks), std::memory_order_release);
    epoch_.store(e, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lk(mu_); }
      wake_.notify_all();
    }
    run_claimed(e);
    // Wait for the chunks others claimed: spin (they run now) unless another process
    // wants the CPUs, then sleep.
    const bool spin = spin_.load(std::memory_order_relaxed);
    const int64_t give_up = now_ns() + kSpinNs;
    int spins = 0;
    while (finished_.load(std::memory_order_acquire) != tasks) {
      if (!spin || (++spins % 64 == 0 && now_ns() > give_up)) {
        std::unique_lock<std::mutex> lk(mu_);
        caller_sleeps_.store(true, std::memory_order_seq_cst);
        done_.wait(lk, [&] { return finished_.load(std::memory_order_seq_cst) == tasks; });
        caller_sleeps_.store(false, std::memory_order_relaxed);
        break;
      }
      RINGSERVE_RELAX();
    }
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  // For tests and logs: the threads (caller included; 0 before the first parallel call),
  // whether they spin now, the parallel calls run, the mode (0 auto, 1 always, 2 never),
  // whether kernels use the pool at all, the smoothed share of samples that found another
  // process wanting the CPUs (in thousandths).
  std::vector<int64_t> info() {
    std::lock_guard<std::mutex> submit(submit_);
    return {workers_.empty() ? 0 : static_cast<int64_t>(workers_.size()) + 1,
            spin_.load() ? 1 : 0, static_cast<int64_t>(jobs_), mode_,
            pool_enabled().load() ? 1 : 0, static_cast<int64_t>(contention_ * 1000)};
  }

 private:
  Pool() : cpus_(usable_cpus()) {
    const char* mode = std::getenv("RINGSERVE_KERNEL_SPIN");
    if (mode != nullptr && std::strcmp(mode, "always") == 0) mode_ = 1;
    if (mode != nullptr && std::strcmp(mode, "never") == 0) mode_ = 2;
    spin_.store(mode_ != 2);
  }

  static std::atomic<Pool*>& instance() {
    static std::atomic<Pool*> p{nullptr};
    return p;
  }
  static bool& tls_in_job() {
    static thread_local bool in = false;
    return in;
  }

  // Whether anyone but us wants the CPUs: runnable tasks beyond our own running threads,
  // smoothed (kEma). While the workers spin, ours are the caller and the spinners. While
  // they sleep, a worker between jobs (woken, or on its way back to sleep: a wake-up that
  // crosses to a halted vCPU takes long under KVM) is runnable though not spinning, so all
  // our threads count as ours then: counted as a neighbour, a 2-core EPYC VM found one at
  // nearly every sample of back-to-back calls, and once spinning had stopped for a busy
  // neighbour it never started again after the neighbour left.
  void sample() {
    if (mode_ != 0) return;
    const int64_t t = now_ns();
    if (t - last_sample_ < kSampleNs) return;
    last_sample_ = t;
    const int running = runnable_tasks();
    if (running < 0) return;  // no /proc: keep the last choice
    const int threads = static_cast<int>(workers_.size()) + 1;
    const int ours = spin_.load(std::memory_order_relaxed)
                         ? 1 + spinners_.load(std::memory_order_relaxed) : threads;
    const bool busy = running - ours > std::max(0, cpus_ - threads);
    contention_ = (1.0 - kEma) * contention_ + (busy ? kEma : 0.0);
    const bool spin = spin_.load(std::memory_order_relaxed);
    if (spin && contention_ > kStopSpin) spin_.store(false, std::memory_order_relaxed);
    if (!spin && contention_ < kSpinAgain) spin_.store(true, std::memory_order_relaxed);
  }

  // The claim word: the job's epoch (low 32 bits) above its chunk count and the next
  // chunk to claim (16 bits each; chunks <= threads). Both in one word, so that a thread
  // that woke for an ended job claims nothing and reads none of the next job's fields.
  static uint64_t claim_word(uint64_t epoch, int64_t tasks) {
    return (epoch << 32) | (static_cast<uint64_t>(tasks) << 16);
  }

  // The next unclaimed chunk of job `epoch`, or -1.
  int64_t claim(uint64_t epoch) {
    uint64_t c = claim_.load(std::memory_order_acquire);
    while (true) {
      if ((c >> 32) != (epoch & 0xFFFFFFFFu)) return -1;
      const uint64_t tasks = (c >> 16) & 0xFFFFu, next = c & 0xFFFFu;
      if (next >= tasks) return -1;
      if (claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                       std::memory_order_acquire))
        return static_cast<int64_t>(next);
    }
  }

  // Claim and run chunks of job `epoch` until none is left; the last to finish wakes a
  // sleeping caller.
  void run_claimed(uint64_t epoch) {
    for (int64_t i; (i = claim(epoch)) >= 0;) {
      task(i);
      const int64_t tasks = static_cast<int64_t>((claim_.load(std::memory_order_acquire) >> 16) & 0xFFFFu);
      if (finished_.fetch_add(1, std::memory_order_seq_cst) + 1 == tasks &&
          caller_sleeps_.load(std::memory_order_seq_cst)) {
        { std::lock_guard<std::mutex> lk(mu_); }
        done_.notify_one();
      }
    }
  }

  void task(int64_t i) {
    const int64_t b = begin_ + i * chunk_;
    if (b >= end_) return;
    tls_in_job() = true;
    try {
      fn_(b, std::min(end_, b + chunk_));
    } catch (...) {
      std::lock_guard<std::mutex> lk(error_mu_);
      if (!error_) error_ = std::current_exception();
    }
    tls_in_job() = false;
  }

  void worker(uint64_t seen) {
    while (true) {
      uint64_t e = epoch_.load(std::memory_order_acquire);
      if (e == seen && spin_.load(std::memory_order_relaxed)) {
        spinners_.fetch_add(1, std::memory_order_relaxed);
        const int64_t give_up = now_ns() + kSpinNs;
        int spins = 0;
        while ((e = epoch_.load(std::memory_order_acquire)) == seen) {
          if (++spins % 64 == 0 && now_ns() > give_up) break;
          RINGSERVE_RELAX();
        }
        spinners_.fetch_sub(1, std::memory_order_relaxed);
      }
      if (e == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lk, [&] { return epoch_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        e = epoch_.load(std::memory_order_acquire);
      }
      if (stop_.load(std::memory_order_acquire)) return;  // resize() ends this pool's threads
      seen = e;
      run_claimed(e);
    }
  }

  // `threads` in all: the caller and threads - 1 workers. Under submit_.
  void resize(int threads) {
    if (!workers_.empty()) {
      stop_.store(true, std::memory_order_seq_cst);
      epoch_.fetch_add(1, std::memory_order_seq_cst);
      { std::lock_guard<std::mutex> lk(mu_); }
      wake_.notify_all();
      for (auto& w : workers_) w.join();
      workers_.clear();
      stop_.store(false, std::memory_order_seq_cst);
    }
    const uint64_t seen = epoch_.load();
    for (int i = 0; i + 1 < threads; ++i) workers_.emplace_back([this, seen] { worker(seen); });
  }

  std::mutex submit_, mu_, error_mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> finished_{0};  // chunks of the current job that have ended
  std::atomic<int> sleepers_{0}, spinners_{0};
  std::atomic<bool> caller_sleeps_{false}, spin_{true}, stop_{false};
  const int cpus_;
  int mode_ = 0;  // 0 auto, 1 always spin, 2 never
  int64_t last_sample_ = 0, jobs_ = 0;
  double contention_ = 0.0;
  std::function<void(int64_t, int64_t)> fn_;
  int64_t begin_ = 0, end_ = 0, chunk_ = 0;
  std::exception_ptr error_;
};

}  // namespace RINGSERVE_NS

// at::parallel_for's contract on the pool above: f(b, e) over chunks of [begin, end) of at
// least `grain` each, one a thread; inline where there is nothing to split or we are
// already inside a parallel call.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  grain = std::max<int64_t>(grain, 1);
  if (!RINGSERVE_NS::pool_enabled().load(std::memory_order_relaxed)) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  auto& pool = RINGSERVE_NS::Pool::get();
  if (end - begin <= grain || at::get_num_threads() <= 1 || pool.in_job() ||
      at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  pool.run(begin, end, grain, f);
}

}  // namespace ringserve
