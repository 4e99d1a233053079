// The kernels' thread pool (thread_pool.h), as seen from Python: for the start-up log and
// the tests.

#include <torch/library.h>

#include "ops.h"
#include "thread_pool.h"

namespace {

std::vector<int64_t> kernel_threads() { return ringserve::RINGSERVE_NS::Pool::get().info(); }

void use_kernel_pool(bool on) { ringserve::RINGSERVE_NS::pool_enabled().store(on); }

// Sums i over [0, n) in parallel chunks of `grain`, each chunk after `sleep_us` of sleep;
// chunk `throw_at` (if >= 0) throws. For tests of the pool itself.
int64_t pool_selftest(int64_t n, int64_t grain, int64_t sleep_us, int64_t throw_at) {
  std::atomic<int64_t> sum{0};
  ringserve::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    if (throw_at >= b && throw_at < e) TORCH_CHECK(false, "pool_selftest: chunk ", b, " throws");
    int64_t s = 0;
    for (int64_t i = b; i < e; ++i) s += i;
    sum += s;
  });
  return sum.load();
}

}  // namespace

RINGSERVE_FRAGMENT(RINGSERVE_NS, m) {
  m.def("kernel_threads() -> int[]", &kernel_threads);
  m.def("use_kernel_pool(bool on) -> ()", &use_kernel_pool);
  m.def("pool_selftest(int n, int grain, int sleep_us, int throw_at) -> int", &pool_selftest);
}
