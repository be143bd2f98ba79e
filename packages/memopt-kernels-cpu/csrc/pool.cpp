// Thread pool: persistent workers woken per run through a generation counter (see pool.hpp).
#include "pool.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace memopt_cpu {
namespace {

constexpr int kMaxThreads = 4096;
constexpr std::size_t kPage = 4096;

thread_local bool t_in_worker = false;  // a part that starts another run runs it inline

// ceil(a / b) for a >= 0, b > 0 without a + b - 1, which overflows for a chunk size near the
// int64 maximum (set_chunk_size accepts any positive int64): 0 parts, a step that did nothing.
int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

// A chunk counter on its own cache line: the parts' counters are bumped by different threads.
struct alignas(64) AlignedCounter {
  std::atomic<std::size_t> v{0};
};

class Pool {
 public:
  explicit Pool(int n) : n_(n) {}

  // Never called for a pool that lost its threads to fork() (see reset_after_fork).
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    start_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  int size() const { return n_; }

  void run(int n_parts, const std::function<void(int)>& fn) {
    if (threads_.empty()) start();
    std::unique_lock<std::mutex> lk(mu_);
    fn_ = &fn;
    n_parts_ = n_parts;
    pending_ = n_parts;
    error_ = nullptr;
    ++generation_;
    start_cv_.notify_all();
    done_cv_.wait(lk, [&] { return pending_ == 0; });
    fn_ = nullptr;
    std::exception_ptr err = error_;
    error_ = nullptr;
    lk.unlock();
    if (err) std::rethrow_exception(err);
  }

 private:
  void start() {
    threads_.reserve(n_);
    try {
      for (int i = 0; i < n_; ++i) threads_.emplace_back([this, i] { work(i); });
    } catch (const std::exception& e) {
      // a thread could not start (a pids limit, RLIMIT_NPROC, address space): stop the others,
      // never wait for a missing one, and say which setting to lower (the bare system error,
      // "Resource temporarily unavailable", named neither the pool nor the thread count)
      const size_t started = threads_.size();
      {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
      }
      start_cv_.notify_all();
      for (auto& t : threads_) t.join();
      threads_.clear();
      stop_ = false;
      throw std::runtime_error("memopt-kernels-cpu could start only " + std::to_string(started) +
                               " of the " + std::to_string(n_) + " threads asked for (" +
                               e.what() + "); lower memopt_kernels_cpu.set_num_threads");
    }
  }

  void work(int index) {
    t_in_worker = true;
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      start_cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (index >= n_parts_) continue;
      const std::function<void(int)>* fn = fn_;
      lk.unlock();
      std::exception_ptr err;
      try {
        (*fn)(index);
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      if (err && !error_) error_ = err;
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  const int n_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  std::vector<std::thread> threads_;
  uint64_t generation_ = 0;
  int n_parts_ = 0;
  int pending_ = 0;
  const std::function<void(int)>* fn_ = nullptr;
  std::exception_ptr error_;
  bool stop_ = false;
};

// run_mu serializes runs and reconfiguration (two Python threads may call in with the GIL
// released). Everything is heap-allocated and never destroyed at exit, so interpreter shutdown
// never waits for worker threads; after fork() the child starts over with fresh objects.
struct State {
  std::mutex run_mu;
  Pool* pool = nullptr;  // created at the first parallel run
  int n_threads = 0;     // 0: default_num_threads(), resolved lazily
  int64_t chunk_size = 65536;
};

State* g_state = nullptr;
std::once_flag g_once;

void reset_after_fork() {
  // The child has only the forking thread: forget (leak) the parent's pool and its mutex, which
  // another thread may have held, and keep the configuration.
  State* old = g_state;
  State* fresh = new State();
  if (old != nullptr) {
    fresh->n_threads = old->n_threads;
    fresh->chunk_size = old->chunk_size;
  }
  g_state = fresh;
}

State& state() {
  std::call_once(g_once, [] {
    g_state = new State();
    pthread_atfork(nullptr, nullptr, reset_after_fork);
  });
  return *g_state;
}

int resolved_threads(State& s) {
  if (s.n_threads <= 0) s.n_threads = default_num_threads();
  return s.n_threads;
}

void run_locked(State& s, int n_parts, const std::function<void(int)>& fn) {
  if (n_parts <= 0) return;
  const int n = resolved_threads(s);
  if (n_parts > n) {
    // The caller split its work for more threads than the pool has now (another thread called
    // set_num_threads in between): thread t runs parts t, t + n, ... The parts are independent
    // ranges, so the results are the same.
    run_locked(s, n, [&](int t) {
      for (int p = t; p < n_parts; p += n) fn(p);
    });
    return;
  }
  if (n_parts == 1 && n == 1) {
    fn(0);
    return;
  }
  if (s.pool == nullptr) s.pool = new Pool(n);
  s.pool->run(n_parts, fn);
}

}  // namespace

int default_num_threads() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return std::min(n, kMaxThreads);
  }
#endif
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(std::min<unsigned>(hw, kMaxThreads)) : 1;
}

void set_num_threads(int n) {
  if (n < 1 || n > kMaxThreads)
    throw std::invalid_argument("set_num_threads: n must be between 1 and " +
                                std::to_string(kMaxThreads) + ", got " + std::to_string(n));
  State& s = state();
  std::lock_guard<std::mutex> lk(s.run_mu);
  if (n == s.n_threads) return;
  delete s.pool;  // joins the old threads; the next run starts n new ones
  s.pool = nullptr;
  s.n_threads = n;
}

int get_num_threads() {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.run_mu);
  return resolved_threads(s);
}

void set_chunk_size(int64_t n) {
  if (n <= 0 || n % 32 != 0)
    throw std::invalid_argument("set_chunk_size: the chunk size must be a positive multiple of 32 "
                                "elements, got " + std::to_string(n));
  State& s = state();
  std::lock_guard<std::mutex> lk(s.run_mu);
  s.chunk_size = n;
}

int64_t get_chunk_size() {
  State& s = state();
  std::lock_guard<std::mutex> lk(s.run_mu);
  return s.chunk_size;
}

void parallel_run(int n_parts, const std::function<void(int)>& fn) {
  if (t_in_worker) {  // nested: no second pool run from inside a part
    for (int p = 0; p < n_parts; ++p) fn(p);
    return;
  }
  State& s = state();
  std::lock_guard<std::mutex> lk(s.run_mu);
  run_locked(s, n_parts, fn);
}

void parallel_blocks(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (t_in_worker) {
    fn(0, n);
    return;
  }
  State& s = state();
  std::lock_guard<std::mutex> lk(s.run_mu);
  const int64_t chunk = s.chunk_size;
  const int64_t by_size = ceil_div(n, chunk);
  const int parts = static_cast<int>(std::min<int64_t>(resolved_threads(s), by_size));
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  const int64_t blocks = (n + 31) / 32;
  auto bound = [&](int p) -> int64_t {
    if (p >= parts) return n;
    return std::min(n, (blocks * p / parts) * 32);
  };
  run_locked(s, parts, [&](int p) {
    const int64_t b = bound(p), e = bound(p + 1);
    if (b < e) fn(b, e);
  });
}

StepPartition partition_step(const int64_t* padded, int64_t n_rows, int64_t chunk_size,
                             int threads) {
  StepPartition out;
  int64_t total = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t b = 0; b < padded[r]; b += chunk_size)
      out.chunks.push_back({r, b, std::min(b + chunk_size, padded[r])});
    total += padded[r];
  }
  if (out.chunks.empty()) return out;
  // At most one part per chunk_size elements of the whole step, as parallel_blocks splits: a
  // step over many small tensors (one chunk each) is otherwise split over every thread, and
  // waking the pool then costs more than the work (on 2 vCPUs, about 100 us against a few us
  // for 8 tensors of 64 elements).
  const int64_t by_size = ceil_div(total, chunk_size);
  const int parts = static_cast<int>(std::min<int64_t>(
      std::min<int64_t>(threads, by_size), static_cast<int64_t>(out.chunks.size())));
  // first[p]: index of the first chunk of part p (contiguous, balanced by element count)
  out.first.assign(static_cast<std::size_t>(parts) + 1, out.chunks.size());
  int64_t before = 0;
  int part = -1;
  for (std::size_t i = 0; i < out.chunks.size(); ++i) {
    const int64_t len = out.chunks[i].end - out.chunks[i].begin;
    const int64_t mid2 = 2 * before + len;  // twice the chunk's midpoint
    // part = floor(mid * parts / total), in 128-bit arithmetic
    const int p = static_cast<int>(
        std::min<__int128>(parts - 1, static_cast<__int128>(mid2) * parts / (2 * total)));
    while (part < p) out.first[++part] = i;
    before += len;
  }
  while (part < parts) out.first[++part] = out.chunks.size();
  return out;
}

void run_step(const IsaKernels& kernels, const StepConfig* cfgs, const int32_t* row_cfg,
              const SlotRow* rows, int64_t n_rows) {
  State& s = state();
  std::unique_lock<std::mutex> lk(s.run_mu, std::defer_lock);
  if (!t_in_worker) lk.lock();
  std::vector<int64_t> padded(static_cast<std::size_t>(n_rows));
  for (int64_t r = 0; r < n_rows; ++r) padded[r] = rows[r].padded;
  const int threads = t_in_worker ? 1 : resolved_threads(s);
  const StepPartition sp = partition_step(padded.data(), n_rows, s.chunk_size, threads);
  const std::vector<StepChunk>& chunks = sp.chunks;
  const std::vector<std::size_t>& first = sp.first;
  if (chunks.empty()) return;
  auto cfg_of = [&](int64_t row) -> const StepConfig& {
    return row_cfg ? cfgs[row_cfg[row]] : cfgs[0];
  };
  const int parts = static_cast<int>(first.size()) - 1;
  if (parts == 1) {  // in the calling thread
    for (const StepChunk& ch : chunks)
      kernels.step_range(cfg_of(ch.row), rows[ch.row], ch.begin, ch.end);
    return;
  }
  // Part p's chunks are handed out from its own counter: pool thread p takes them in order, and
  // a thread that has finished its part takes the next untaken chunks of the others (visited
  // from p + 1 on). Without this, one thread the OS preempts (the training loop's own thread,
  // the CUDA driver's, another process's) holds up the whole step: memopt-offload's updates
  // run while the main thread drives backward. Stealing only starts where a part is behind, so
  // the pages of a balanced step are still touched by their own thread (first_touch's rule).
  // Each element's result is independent of which thread computes it: same bits.
  std::vector<AlignedCounter> next(static_cast<std::size_t>(parts));
  for (int p = 0; p < parts; ++p) next[p].v.store(first[p], std::memory_order_relaxed);
  auto drain = [&](int q) {
    for (;;) {
      const std::size_t i = next[q].v.fetch_add(1, std::memory_order_relaxed);
      if (i >= first[q + 1]) return;
      const int64_t row = chunks[i].row;
      kernels.step_range(cfg_of(row), rows[row], chunks[i].begin, chunks[i].end);
    }
  };
  run_locked(s, parts, [&](int p) {
    for (int k = 0; k < parts; ++k) drain((p + k) % parts);
  });
}

void first_touch(void* addr, std::size_t nbytes) {
  if (nbytes == 0) return;
  if (addr == nullptr) throw std::invalid_argument("first_touch: null address");
  // Part boundaries fall on page boundaries of the address space, so no page is shared.
  const std::uintptr_t lo = reinterpret_cast<std::uintptr_t>(addr);
  const std::uintptr_t hi = lo + nbytes;
  const std::uintptr_t page0 = lo & ~static_cast<std::uintptr_t>(kPage - 1);
  const std::size_t pages = (hi - page0 + kPage - 1) / kPage;
  State& s = state();
  std::lock_guard<std::mutex> lk(s.run_mu);
  const int parts = static_cast<int>(std::min<std::size_t>(resolved_threads(s), pages));
  auto bound = [&](int p) -> std::uintptr_t {
    if (p >= parts) return hi;
    return std::min(hi, std::max(lo, page0 + pages * p / parts * kPage));
  };
  run_locked(s, parts, [&](int p) {
    const std::uintptr_t b = bound(p), e = bound(p + 1);
    if (b < e) std::memset(reinterpret_cast<void*>(b), 0, e - b);
  });
}

}  // namespace memopt_cpu
