// The CUDA emulator's runtime and scheduler (see emulator.h).
#include "tests/testing/cuda_emulator/emulator.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <boost/context/fiber.hpp>
#include <boost/context/stack_context.hpp>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

struct CUstream_st {
  unsigned int flags = 0;
  // Stream capture (cudaStreamBeginCapture): the recorded work, and
  // whether a refused call invalidated the capture.
  bool capturing = false;
  bool capture_invalidated = false;
  std::vector<std::function<void()>> captured;
};
struct CUgraph_st {
  std::vector<std::function<void()>> ops;
};
struct CUgraphExec_st {
  std::vector<std::function<void()>> ops;
};
struct CUevent_st {
  bool recorded = false;
  bool done = false;
  uint64_t seq = 0;         // the latest record operation's
  uint64_t generation = 0;  // records so far; only the latest one counts
  std::chrono::steady_clock::time_point time;
};

uint3 threadIdx{0, 0, 0};
uint3 blockIdx{0, 0, 0};
dim3 blockDim{1, 1, 1};
dim3 gridDim{1, 1, 1};

namespace gtopk {
namespace cuda_emu {
namespace {

namespace bctx = boost::context;

// ---------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------
enum class OrderKind { kForward, kReverse, kShuffle };

struct Settings {
  OrderKind order = OrderKind::kForward;
  uint64_t seed = 1;
  int sms = 132;
  size_t memory_bytes = size_t{4} << 30;
  int blocks_per_sm = 0;  // occupancy answer; 0: 2048 threads' worth
};

// GTOPK_CUDA_EMU="order=reverse sms=2 ...": space-separated key=value.
// Mutable only through SetOrderForTesting.
Settings& MutableSettings() {
  static Settings settings = [] {
    Settings s;
    const char* env = std::getenv("GTOPK_CUDA_EMU");
    std::string text = env != nullptr ? env : "";
    size_t pos = 0;
    while (pos < text.size()) {
      size_t end = text.find(' ', pos);
      if (end == std::string::npos) end = text.size();
      const std::string item = text.substr(pos, end - pos);
      pos = end + 1;
      if (item.empty()) continue;
      const size_t eq = item.find('=');
      const std::string key = item.substr(0, eq);
      const std::string value =
          eq == std::string::npos ? "" : item.substr(eq + 1);
      char* rest = nullptr;
      const unsigned long long number = std::strtoull(value.c_str(), &rest, 10);
      const bool is_number = !value.empty() && rest != nullptr && *rest == 0;
      if (key == "order" && value == "forward") {
        s.order = OrderKind::kForward;
      } else if (key == "order" && value == "reverse") {
        s.order = OrderKind::kReverse;
      } else if (key == "order" && value == "shuffle") {
        s.order = OrderKind::kShuffle;
      } else if (key == "seed" && is_number) {
        s.seed = number;
      } else if (key == "sms" && is_number && number >= 1 && number <= 1024) {
        s.sms = static_cast<int>(number);
      } else if (key == "memory_bytes" && is_number) {
        s.memory_bytes = static_cast<size_t>(number);
      } else if (key == "blocks_per_sm" && is_number && number >= 1 &&
                 number <= 32) {
        s.blocks_per_sm = static_cast<int>(number);
      } else {
        std::fprintf(stderr,
                     "GTOPK_CUDA_EMU: bad setting '%s' (want order=forward|"
                     "reverse|shuffle, seed=N, sms=1..1024, memory_bytes=N, "
                     "blocks_per_sm=1..32)\n",
                     item.c_str());
        std::abort();
      }
    }
    if (!text.empty()) {
      // Say once which schedule ran, so a log shows the settings applied.
      std::fprintf(
          stderr,
          "gtopk CUDA emulator: order=%s seed=%llu sms=%d "
          "memory_bytes=%zu blocks_per_sm=%s (GTOPK_CUDA_EMU=\"%s\")\n",
          s.order == OrderKind::kForward
              ? "forward"
              : (s.order == OrderKind::kReverse ? "reverse" : "shuffle"),
          static_cast<unsigned long long>(s.seed), s.sms, s.memory_bytes,
          s.blocks_per_sm > 0 ? std::to_string(s.blocks_per_sm).c_str()
                              : "2048-threads-worth",
          text.c_str());
    }
    return s;
  }();
  return settings;
}
const Settings& GetSettings() { return MutableSettings(); }

// ---------------------------------------------------------------------------
// Global state (guarded by Mutex())
// ---------------------------------------------------------------------------
std::mutex& Mutex() {
  static std::mutex mutex;
  return mutex;
}

struct Allocation {
  size_t bytes = 0;
  bool pinned = false;
  void* map_base = nullptr;
  size_t map_bytes = 0;
  uint64_t serial = 0;
};

struct State {
  std::map<uintptr_t, Allocation> allocations;              // by user address
  std::deque<std::pair<uintptr_t, Allocation>> quarantine;  // freed, PROT_NONE
  size_t device_bytes = 0;
  uint64_t serial = 0;
  // Work on streams not yet run, in enqueue order (see RunThrough).
  struct Op {
    cudaStream_t stream;
    uint64_t seq;
    std::function<void()> fn;
  };
  std::deque<Op> queue;
  uint64_t next_seq = 0;
  std::set<CUstream_st*> streams;
  std::set<CUevent_st*> events;
  uint64_t kernels_run = 0;
  std::mt19937_64 rng{1};
};

// CUDA's last error is per host thread.
thread_local cudaError_t t_last_error = cudaSuccess;

State& S() {
  static State* state = [] {
    auto* s = new State;
    s->rng.seed(GetSettings().seed);
    return s;
  }();
  return *state;
}

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// The allocation holding [p, p + bytes), or nullptr.
const Allocation* Find(const void* p, size_t bytes) {
  State& s = S();
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = s.allocations.upper_bound(a);
  if (it == s.allocations.begin()) return nullptr;
  --it;
  if (a < it->first || a + bytes > it->first + it->second.bytes) return nullptr;
  if (bytes == 0 && a > it->first + it->second.bytes) return nullptr;
  return &it->second;
}

// ---------------------------------------------------------------------------
// The running kernel (for messages and the scheduler)
// ---------------------------------------------------------------------------
enum class Wait { kRunnable, kBarrier, kBallot, kExited };

struct Thread {
  bctx::fiber fiber;  // the thread while it is suspended (else empty)
  bool started = false;
  Wait wait = Wait::kRunnable;
  const char* file = nullptr;  // barrier site
  int line = 0;
  bool collective = false;  // the barrier is a cub block collective's
  unsigned mask = 0;        // ballot
  int vote = 0;
  unsigned result = 0;
};

// Who switched to the fiber that runs now: a thread's index, or one of
// these (see StoreSwitcher).
constexpr int kFromScheduler = -1;
constexpr int kFromExited = -2;

struct Running {
  const char* kernel = nullptr;
  std::vector<Thread>* threads = nullptr;
  int current = -1;
  // The block being run (RunBlock): its body, this round's thread order
  // (ThreadOrder: empty for the forward order) and the position in it of
  // the next thread to run, the scheduler while threads run, and who made
  // the last switch.
  const std::function<void()>* body = nullptr;
  std::vector<int> order;
  size_t next = 0;
  bctx::fiber scheduler;
  int from = kFromScheduler;
};
Running g_run;  // guarded by Mutex() (kernels run with it held)

}  // namespace

void Fail(const char* format, ...) {
  char message[2048];
  va_list args;
  va_start(args, format);
  std::vsnprintf(message, sizeof(message), format, args);
  va_end(args);
  if (g_run.kernel != nullptr) {
    std::fprintf(stderr,
                 "gtopk CUDA emulator: %s (kernel %s, block %u of %u, thread "
                 "%d of %u)\n",
                 message, g_run.kernel, blockIdx.x, gridDim.x, g_run.current,
                 blockDim.x);
  } else {
    std::fprintf(stderr, "gtopk CUDA emulator: %s\n", message);
  }
  std::fflush(stderr);
  std::abort();
}

namespace {

// ---------------------------------------------------------------------------
// Fiber stacks: a pool of guarded stacks (a guard page below each)
// ---------------------------------------------------------------------------
constexpr size_t kStackBytes = 256 * 1024;

struct StackPool {
  std::vector<void*> free;
  bctx::stack_context allocate() {
    void* base;
    if (!free.empty()) {
      base = free.back();
      free.pop_back();
    } else {
      base = mmap(nullptr, kStackBytes + PageSize(), PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (base == MAP_FAILED) Fail("cannot map a fiber stack");
      mprotect(base, PageSize(), PROT_NONE);
    }
    bctx::stack_context sctx;
    sctx.size = kStackBytes;
    sctx.sp = static_cast<char*>(base) + PageSize() + kStackBytes;
    return sctx;
  }
  void deallocate(bctx::stack_context& sctx) noexcept {
    free.push_back(static_cast<char*>(sctx.sp) - kStackBytes - PageSize());
  }
};
StackPool g_stacks;

struct StackAllocator {
  bctx::stack_context allocate() { return g_stacks.allocate(); }
  void deallocate(bctx::stack_context& sctx) noexcept {
    g_stacks.deallocate(sctx);
  }
};

// ---------------------------------------------------------------------------
// Invalid accesses: a SIGSEGV handler that names the allocation
// ---------------------------------------------------------------------------
void DescribeAddress(uintptr_t a, char* out, size_t size) {
  State& s = S();
  const Allocation* best = nullptr;
  uintptr_t best_start = 0;
  long long best_distance = 0;
  for (const auto& [start, alloc] : s.allocations) {
    long long distance;
    if (a < start) {
      distance = static_cast<long long>(start - a);
    } else if (a >= start + alloc.bytes) {
      distance = static_cast<long long>(a - (start + alloc.bytes)) + 1;
    } else {
      distance = 0;
    }
    if (best == nullptr || distance < best_distance) {
      best = &alloc;
      best_start = start;
      best_distance = distance;
    }
  }
  // Inside a freed allocation (still PROT_NONE in the quarantine)?
  for (const auto& [start, freed] : s.quarantine) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(freed.map_base);
    if (a >= base && a < base + freed.map_bytes &&
        (best == nullptr || best_distance != 0)) {
      std::snprintf(out, size,
                    "%lld bytes from the start of freed %s allocation #%llu "
                    "[%p, +%zu): use after free",
                    static_cast<long long>(a - start),
                    freed.pinned ? "pinned" : "device",
                    static_cast<unsigned long long>(freed.serial),
                    reinterpret_cast<void*>(start), freed.bytes);
      return;
    }
  }
  if (best == nullptr || best_distance > (1 << 20)) {
    std::snprintf(out, size, "not near any emulated allocation");
  } else if (a < best_start) {
    std::snprintf(out, size, "%llu bytes before %s allocation #%llu [%p, +%zu)",
                  static_cast<unsigned long long>(best_start - a),
                  best->pinned ? "pinned" : "device",
                  static_cast<unsigned long long>(best->serial),
                  reinterpret_cast<void*>(best_start), best->bytes);
  } else {
    std::snprintf(out, size,
                  "%llu bytes past the end of %s allocation #%llu [%p, +%zu)",
                  static_cast<unsigned long long>(a - best_start - best->bytes),
                  best->pinned ? "pinned" : "device",
                  static_cast<unsigned long long>(best->serial),
                  reinterpret_cast<void*>(best_start), best->bytes);
  }
}

void OnSegv(int sig, siginfo_t* info, void*) {
  char where[512];
  DescribeAddress(reinterpret_cast<uintptr_t>(info->si_addr), where,
                  sizeof(where));
  char message[1024];
  if (g_run.kernel != nullptr) {
    std::snprintf(message, sizeof(message),
                  "gtopk CUDA emulator: invalid memory access at %p (%s) in "
                  "kernel %s, block %u, thread %d\n",
                  info->si_addr, where, g_run.kernel, blockIdx.x,
                  g_run.current);
  } else {
    std::snprintf(message, sizeof(message),
                  "gtopk CUDA emulator: invalid memory access at %p (%s) "
                  "outside a kernel\n",
                  info->si_addr, where);
  }
  ssize_t ignored = write(2, message, std::strlen(message));
  (void)ignored;
  signal(sig, SIG_DFL);  // returning re-executes the access and dies
}

void InstallSegvHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = OnSegv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
  });
  // A fault on a fiber stack needs a stack of its own for the handler.
  thread_local bool has_altstack = false;
  if (!has_altstack) {
    stack_t ss;
    ss.ss_size = 64 * 1024;
    ss.ss_sp = std::malloc(ss.ss_size);
    ss.ss_flags = 0;
    sigaltstack(&ss, nullptr);
    has_altstack = true;
  }
}

// ---------------------------------------------------------------------------
// The scheduler
// ---------------------------------------------------------------------------
Thread& Me(const char* what) {
  if (g_run.threads == nullptr || g_run.current < 0) {
    Fail("%s called outside a kernel", what);
  }
  return (*g_run.threads)[g_run.current];
}

// The block's threads switch to each other directly (one context switch per
// suspension, not two through the scheduler), in the round's order, and a
// thread that exits runs the next thread not yet started on its own fiber
// (no switch at all): the order every thread runs in, and so every result,
// is the scheduler's round by round, as if each thread had its own fiber
// resumed by the scheduler. The scheduler runs only between rounds, to open
// barriers and ballots (Release).

// Keeps the continuation a switch to this fiber returned: the suspended
// thread's (it is resumed from there), the scheduler's, or nothing (the
// switch came from a fiber whose threads all exited).
void StoreSwitcher(bctx::fiber&& from) {
  if (g_run.from >= 0) {
    (*g_run.threads)[g_run.from].fiber = std::move(from);
  } else if (g_run.from == kFromScheduler) {
    g_run.scheduler = std::move(from);
  }
}

// This round's order of `n` threads (or blocks) into `order`; empty for
// the forward order, the identity (every round of every block asks: no
// allocation then).
void ThreadOrder(int n, std::vector<int>& order) {
  order.clear();
  if (GetSettings().order == OrderKind::kForward) return;
  order.resize(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  if (GetSettings().order == OrderKind::kReverse) {
    std::reverse(order.begin(), order.end());
  } else {
    std::shuffle(order.begin(), order.end(), S().rng);
  }
}

// The `at`-th entry of a round's order (ThreadOrder): the identity when
// `order` is empty.
int OrderAt(const std::vector<int>& order, size_t at) {
  return order.empty() ? static_cast<int>(at) : order[at];
}

// Makes the next runnable thread of the round current. Returns its
// continuation when it was suspended, an empty fiber when it has not
// started (*fresh), and an empty fiber with *fresh false when the round has
// no runnable thread left.
bctx::fiber TakeNext(bool* fresh) {
  std::vector<Thread>& threads = *g_run.threads;
  *fresh = false;
  while (g_run.next < threads.size()) {
    const int i = OrderAt(g_run.order, g_run.next++);
    Thread& t = threads[i];
    if (t.wait != Wait::kRunnable) continue;
    g_run.current = i;
    threadIdx = uint3{static_cast<unsigned>(i), 0, 0};
    if (!t.started) {
      t.started = true;
      *fresh = true;
      return bctx::fiber();
    }
    return std::move(t.fiber);
  }
  return bctx::fiber();
}

bctx::fiber NewThreadFiber();

// The continuation to switch to after the current thread stopped running:
// the next runnable thread (a new fiber for one not yet started), or the
// scheduler at the end of the round.
bctx::fiber NextContinuation() {
  bool fresh = false;
  bctx::fiber next = TakeNext(&fresh);
  if (fresh) return NewThreadFiber();
  if (next) return next;
  return std::move(g_run.scheduler);
}

// A fiber's life: the current thread's body, then, while the next thread
// of the round has not started, that thread's body on the same fiber.
bctx::fiber RunThreads() {
  std::vector<Thread>& threads = *g_run.threads;
  while (true) {
    const int me = g_run.current;
    (*g_run.body)();
    threads[me].wait = Wait::kExited;
    bool fresh = false;
    bctx::fiber next = TakeNext(&fresh);
    if (fresh) continue;
    g_run.from = kFromExited;
    return next ? std::move(next) : std::move(g_run.scheduler);
  }
}

bctx::fiber NewThreadFiber() {
  return bctx::fiber(std::allocator_arg, StackAllocator(),
                     [](bctx::fiber&& from) {
                       StoreSwitcher(std::move(from));
                       return RunThreads();
                     });
}

// The current thread waits (its wait set): the next one runs.
void Suspend(Thread& me) {
  const int self = static_cast<int>(&me - g_run.threads->data());
  bctx::fiber next = NextContinuation();
  g_run.from = self;
  StoreSwitcher(std::move(next).resume());
}

// Opens the barrier or ballots that every participant reached; false when
// none could be opened (then the block is stuck).
bool Release(std::vector<Thread>& threads) {
  const int n = static_cast<int>(threads.size());
  int exited = 0, at_barrier = 0;
  const Thread* first_barrier = nullptr;
  for (const Thread& t : threads) {
    if (t.wait == Wait::kExited) ++exited;
    if (t.wait == Wait::kBarrier) {
      ++at_barrier;
      if (first_barrier == nullptr) first_barrier = &t;
    }
  }
  bool released = false;
  if (at_barrier > 0 && at_barrier + exited == n) {
    for (int i = 0; i < n; ++i) {
      const Thread& t = threads[i];
      if (t.wait == Wait::kBarrier &&
          (t.line != first_barrier->line ||
           (t.file != first_barrier->file &&
            std::strcmp(t.file, first_barrier->file) != 0))) {
        g_run.current = i;
        Fail(
            "divergent __syncthreads: this thread waits at %s:%d, thread "
            "%d at %s:%d",
            t.file, t.line, static_cast<int>(first_barrier - &threads[0]),
            first_barrier->file, first_barrier->line);
      }
    }
    if (exited > 0 && first_barrier->collective) {
      // CUB's block collectives need every thread of the block: an exited
      // thread's partial would be read unwritten.
      for (int i = 0; i < n; ++i) {
        if (threads[i].wait == Wait::kExited) {
          Fail(
              "block collective at %s:%d reached while thread %d has "
              "exited",
              first_barrier->file, first_barrier->line, i);
        }
      }
    }
    for (Thread& t : threads) {
      if (t.wait == Wait::kBarrier) t.wait = Wait::kRunnable;
    }
    released = true;
  }
  for (int warp = 0; warp * 32 < n; ++warp) {
    const int lanes = std::min(32, n - warp * 32);
    for (int lane = 0; lane < lanes; ++lane) {
      Thread& t = threads[warp * 32 + lane];
      if (t.wait != Wait::kBallot) continue;
      bool ready = true;
      unsigned result = 0;
      for (int other = 0; other < 32; ++other) {
        if ((t.mask >> other & 1u) == 0) continue;
        if (other >= lanes) {
          g_run.current = warp * 32 + lane;
          Fail(
              "__ballot_sync mask 0x%08x names lane %d, which does not exist "
              "(block of %d threads)",
              t.mask, other, n);
        }
        const Thread& o = threads[warp * 32 + other];
        if (o.wait == Wait::kExited) {
          g_run.current = warp * 32 + lane;
          Fail("__ballot_sync mask 0x%08x names lane %d, which has exited",
               t.mask, other);
        }
        if (o.wait != Wait::kBallot) {
          ready = false;
          break;
        }
        if (o.mask != t.mask) {
          g_run.current = warp * 32 + lane;
          Fail(
              "__ballot_sync masks differ in one warp: 0x%08x and 0x%08x "
              "(lane %d)",
              t.mask, o.mask, other);
        }
        if (o.vote) result |= 1u << other;
      }
      if (!ready) continue;
      for (int other = 0; other < 32; ++other) {
        if ((t.mask >> other & 1u) == 0) continue;
        Thread& o = threads[warp * 32 + other];
        o.result = result;
        o.wait = Wait::kRunnable;
      }
      released = true;
    }
  }
  return released;
}

void RunBlock(const std::function<void()>& body, int n) {
  std::vector<Thread> threads(n);
  g_run.threads = &threads;
  g_run.body = &body;
  while (true) {
    ThreadOrder(n, g_run.order);
    g_run.next = 0;
    bool fresh = false;
    bctx::fiber first = TakeNext(&fresh);
    if (fresh) first = NewThreadFiber();
    if (first) {
      // Returns when the round's last thread switches back.
      g_run.from = kFromScheduler;
      StoreSwitcher(std::move(first).resume());
    }
    if (std::all_of(threads.begin(), threads.end(),
                    [](const Thread& t) { return t.wait == Wait::kExited; })) {
      break;
    }
    if (!Release(threads)) {
      std::string where;
      for (int i = 0; i < n && where.size() < 400; ++i) {
        const Thread& t = threads[i];
        if (t.wait == Wait::kBarrier) {
          where += " thread " + std::to_string(i) + " at " + t.file + ":" +
                   std::to_string(t.line) + ";";
        } else if (t.wait == Wait::kBallot) {
          where += " thread " + std::to_string(i) + " at a ballot;";
        }
      }
      g_run.current = -1;
      Fail("deadlock: no barrier or ballot can complete:%s", where.c_str());
    }
  }
  g_run.current = -1;
  g_run.threads = nullptr;
  g_run.body = nullptr;
}

void CheckSlack(uintptr_t start, const Allocation& a, const char* when);

void RunGrid(const char* name, dim3 grid, dim3 block,
             const std::function<void()>& body) {
  InstallSegvHandler();
  g_run.kernel = name;
  gridDim = grid;
  blockDim = block;
  std::vector<int> order;
  ThreadOrder(static_cast<int>(grid.x), order);
  for (unsigned at = 0; at < grid.x; ++at) {
    const int b = OrderAt(order, at);
    blockIdx = uint3{static_cast<unsigned>(b), 0, 0};
    RunBlock(body, static_cast<int>(block.x));
  }
  g_run.kernel = nullptr;
  char when[256];
  std::snprintf(when, sizeof(when), "after kernel %s", name);
  for (const auto& [start, alloc] : S().allocations) {
    CheckSlack(start, alloc, when);
  }
  ++S().kernels_run;
}

// Stream work runs as late as CUDA allows: only when the host waits for it
// (a synchronisation, a blocking copy) and then only what that wait needs,
// so a missing dependency between streams reads stale or poisoned memory
// as it can on a GPU. Dependencies: program order within a stream, and the
// legacy default stream (nullptr) against every blocking stream (created
// without cudaStreamNonBlocking) in both directions. The caller of these
// holds Mutex().
uint64_t Enqueue(cudaStream_t stream, std::function<void()> fn) {
  State& s = S();
  if (stream != nullptr && stream->capturing) {
    stream->captured.push_back(std::move(fn));
    return 0;  // recorded, not queued: nothing to run through
  }
  const uint64_t seq = ++s.next_seq;
  s.queue.push_back(State::Op{stream, seq, std::move(fn)});
  return seq;
}

bool Blocking(cudaStream_t stream) {
  return stream != nullptr && (stream->flags & cudaStreamNonBlocking) == 0;
}

// Runs the queued operation `seq` (nothing if it already ran) and the
// queued operations it depends on, in enqueue order.
void RunThrough(uint64_t seq) {
  State& s = S();
  size_t last = 0;
  while (last < s.queue.size() && s.queue[last].seq != seq) ++last;
  if (last == s.queue.size()) return;
  std::vector<char> needed(last + 1, 0);
  needed[last] = 1;
  std::set<cudaStream_t> streams{s.queue[last].stream};
  bool legacy = s.queue[last].stream == nullptr;
  bool blocking = Blocking(s.queue[last].stream);
  for (size_t j = last; j-- > 0;) {
    const cudaStream_t stream = s.queue[j].stream;
    if (streams.count(stream) != 0 || (legacy && Blocking(stream)) ||
        (blocking && stream == nullptr)) {
      needed[j] = 1;
      streams.insert(stream);
      legacy = legacy || stream == nullptr;
      blocking = blocking || Blocking(stream);
    }
  }
  std::vector<State::Op> run;
  std::deque<State::Op> rest;
  for (size_t i = 0; i < s.queue.size(); ++i) {
    if (i <= last && needed[i]) {
      run.push_back(std::move(s.queue[i]));
    } else {
      rest.push_back(std::move(s.queue[i]));
    }
  }
  s.queue = std::move(rest);
  for (State::Op& op : run) op.fn();
}

// Everything enqueued on `stream` so far, with what it depends on.
void SyncStream(cudaStream_t stream) {
  RunThrough(Enqueue(stream, [] {}));
}

// Everything queued (cudaDeviceSynchronize, cudaFree).
void Drain() {
  State& s = S();
  while (!s.queue.empty()) {
    State::Op op = std::move(s.queue.front());
    s.queue.pop_front();
    op.fn();
  }
}

cudaError_t SetError(cudaError_t e) {
  if (e != cudaSuccess) t_last_error = e;
  return e;
}

bool ValidStream(cudaStream_t stream) {
  return stream == nullptr || S().streams.count(stream) != 0;
}

// Device memory for [p, p + bytes): device (not pinned) allocations only
// unless `pinned_ok`.
bool InDevice(const void* p, size_t bytes, bool pinned_ok) {
  const Allocation* a = Find(p, bytes);
  return a != nullptr && (pinned_ok || !a->pinned);
}
bool IsPinned(const void* p, size_t bytes) {
  const Allocation* a = Find(p, bytes);
  return a != nullptr && a->pinned;
}

constexpr unsigned char kSlackCanary = 0xc5;

// Fails when something wrote into the page-rounding slack in front of the
// allocation at `start` (a write before its start that the guard page could
// not catch).
void CheckSlack(uintptr_t start, const Allocation& a, const char* when) {
  const auto* slack =
      reinterpret_cast<const unsigned char*>(a.map_base) + PageSize();
  const auto* user = reinterpret_cast<const unsigned char*>(start);
  for (const unsigned char* p = slack; p < user; ++p) {
    if (*p != kSlackCanary) {
      Fail(
          "write %lld bytes before the start of %s allocation #%llu "
          "[%p, +%zu) (found %s)",
          static_cast<long long>(user - p), a.pinned ? "pinned" : "device",
          static_cast<unsigned long long>(a.serial),
          reinterpret_cast<const void*>(start), a.bytes, when);
    }
  }
}

cudaError_t Allocate(void** ptr, size_t bytes, bool pinned) {
  if (ptr == nullptr) return SetError(cudaErrorInvalidValue);
  *ptr = nullptr;
  if (bytes == 0) return cudaSuccess;
  State& s = S();
  if (!pinned && bytes > GetSettings().memory_bytes - s.device_bytes) {
    return SetError(cudaErrorMemoryAllocation);
  }
  const size_t page = PageSize();
  const size_t data = (bytes + page - 1) / page * page;
  const size_t map_bytes = data + 2 * page;
  void* base = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return SetError(cudaErrorMemoryAllocation);
  char* b = static_cast<char*>(base);
  mprotect(b, page, PROT_NONE);
  mprotect(b + page + data, page, PROT_NONE);
  // The end of the buffer (rounded to 16 bytes, CUDA's float4 alignment)
  // touches the guard page behind it.
  char* user = b + page + data - (bytes + 15) / 16 * 16;
  std::memset(user, 0xff, bytes);  // what nothing wrote reads as NaN
  // The slack in front of the buffer cannot be a guard page; a canary there
  // catches writes before the start (checked after each kernel and at free).
  std::memset(b + page, kSlackCanary, static_cast<size_t>(user - (b + page)));
  Allocation a;
  a.bytes = bytes;
  a.pinned = pinned;
  a.map_base = base;
  a.map_bytes = map_bytes;
  a.serial = ++s.serial;
  s.allocations[reinterpret_cast<uintptr_t>(user)] = a;
  if (!pinned) s.device_bytes += bytes;
  *ptr = user;
  return cudaSuccess;
}

cudaError_t FreeAllocation(void* ptr, bool pinned) {
  if (ptr == nullptr) return cudaSuccess;
  State& s = S();
  Drain();  // cudaFree synchronises the device
  auto it = s.allocations.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == s.allocations.end() || it->second.pinned != pinned) {
    std::fprintf(stderr,
                 "gtopk CUDA emulator: %s(%p): not a pointer %s returned\n",
                 pinned ? "cudaFreeHost" : "cudaFree", ptr,
                 pinned ? "cudaMallocHost" : "cudaMalloc");
    return SetError(pinned ? cudaErrorInvalidValue
                           : cudaErrorInvalidDevicePointer);
  }
  const Allocation a = it->second;
  const uintptr_t it_start = it->first;
  CheckSlack(it_start, a, "at free");
  s.allocations.erase(it);
  if (!pinned) s.device_bytes -= a.bytes;
  // Use after free faults: keep the range inaccessible for a while.
  mprotect(a.map_base, a.map_bytes, PROT_NONE);
  madvise(a.map_base, a.map_bytes, MADV_DONTNEED);
  s.quarantine.emplace_back(it_start, a);
  if (s.quarantine.size() > 256) {
    munmap(s.quarantine.front().second.map_base,
           s.quarantine.front().second.map_bytes);
    s.quarantine.pop_front();
  }
  return cudaSuccess;
}

// Checks the pointers of a copy against its kind; resolves cudaMemcpyDefault.
cudaError_t CheckCopy(void* dst, const void* src, size_t bytes,
                      cudaMemcpyKind* kind) {
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return SetError(cudaErrorInvalidValue);
  const bool dst_dev = InDevice(dst, bytes, /*pinned_ok=*/false);
  const bool src_dev = InDevice(src, bytes, false);
  const bool dst_acc = InDevice(dst, bytes, true);
  const bool src_acc = InDevice(src, bytes, true);
  if (*kind == cudaMemcpyDefault) {
    if (dst_dev) {
      *kind = src_dev ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice;
    } else {
      *kind = src_dev ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost;
    }
  }
  const char* problem = nullptr;
  switch (*kind) {
    case cudaMemcpyHostToDevice:
      if (!dst_acc) problem = "destination is not a device range";
      if (src_dev) problem = "source is device memory";
      break;
    case cudaMemcpyDeviceToHost:
      if (!src_acc) problem = "source is not a device range";
      if (dst_dev) problem = "destination is device memory";
      break;
    case cudaMemcpyDeviceToDevice:
      if (!dst_acc || !src_acc) problem = "not both device ranges";
      break;
    case cudaMemcpyHostToHost:
      if (dst_dev || src_dev) problem = "device memory in a host copy";
      break;
    default:
      return SetError(cudaErrorInvalidMemcpyDirection);
  }
  if (problem != nullptr) {
    std::fprintf(stderr,
                 "gtopk CUDA emulator: cudaMemcpy(dst %p, src %p, %zu bytes, "
                 "kind %d): %s\n",
                 dst, src, bytes, static_cast<int>(*kind), problem);
    return SetError(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

}  // namespace

// ---------------------------------------------------------------------------
// Emulator entry points used by the headers
// ---------------------------------------------------------------------------
unsigned ThreadInBlock() {
  Me("a block collective");
  return static_cast<unsigned>(g_run.current);
}

void CheckBlockSize(const char* what, int template_threads) {
  Me(what);
  if (blockDim.x != static_cast<unsigned>(template_threads)) {
    Fail("%s<..., %d> used in a block of %u threads", what, template_threads,
         blockDim.x);
  }
}

void BlockBarrier(const char* file, int line) {
  Thread& me = Me("__syncthreads");
  me.wait = Wait::kBarrier;
  me.file = file;
  me.line = line;
  me.collective = false;
  Suspend(me);
}

void CollectiveBarrier(const char* what, const char* file, int line) {
  Thread& me = Me(what);
  me.wait = Wait::kBarrier;
  me.file = file;
  me.line = line;
  me.collective = true;
  Suspend(me);
}

bool IsDeviceAccessible(const void* p) {
  std::lock_guard<std::mutex> lock(Mutex());
  return Find(p, 0) != nullptr;
}

cudaError_t LaunchGrid(const char* name, dim3 grid, dim3 block,
                       cudaStream_t stream, std::function<void()> body) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (!ValidStream(stream)) return SetError(cudaErrorInvalidResourceHandle);
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu ||
      grid.y > 65535 || grid.z > 65535 || threads == 0 || threads > 1024 ||
      block.z > 64) {
    return SetError(cudaErrorInvalidConfiguration);
  }
  if (grid.y != 1 || grid.z != 1 || block.y != 1 || block.z != 1) {
    Fail("launch of %s: the emulator runs 1-D grids and blocks only", name);
  }
  Enqueue(stream, [name, grid, block, body = std::move(body)]() {
    RunGrid(name, grid, block, body);
  });
  return cudaSuccess;
}

uint64_t KernelsRun() {
  std::lock_guard<std::mutex> lock(Mutex());
  return S().kernels_run;
}

void SetOrderForTesting(const char* order) {
  std::lock_guard<std::mutex> lock(Mutex());
  const std::string o = order;
  if (o == "forward") {
    MutableSettings().order = OrderKind::kForward;
  } else if (o == "reverse") {
    MutableSettings().order = OrderKind::kReverse;
  } else if (o == "shuffle") {
    MutableSettings().order = OrderKind::kShuffle;
  } else {
    Fail("SetOrderForTesting: unknown order '%s'", order);
  }
}

const char* Order() {
  switch (GetSettings().order) {
    case OrderKind::kForward:
      return "forward";
    case OrderKind::kReverse:
      return "reverse";
    case OrderKind::kShuffle:
      return "shuffle";
  }
  return "forward";
}

}  // namespace cuda_emu
}  // namespace gtopk

// ---------------------------------------------------------------------------
// Device-side intrinsics with scheduling
// ---------------------------------------------------------------------------
using gtopk::cuda_emu::Fail;

unsigned int __ballot_sync(unsigned int mask, int predicate) {
  using namespace gtopk::cuda_emu;
  Thread& me = Me("__ballot_sync");
  const int lane = g_run.current % 32;
  if ((mask >> lane & 1u) == 0) {
    Fail("__ballot_sync mask 0x%08x does not name the calling lane %d", mask,
         lane);
  }
  me.wait = Wait::kBallot;
  me.mask = mask;
  me.vote = predicate != 0;
  Suspend(me);
  return me.result;
}

void __gtopk_emu_syncthreads(const char* file, int line) {
  gtopk::cuda_emu::BlockBarrier(file, line);
}

// ---------------------------------------------------------------------------
// Runtime API
// ---------------------------------------------------------------------------
using gtopk::cuda_emu::Mutex;
using gtopk::cuda_emu::S;

int __gtopk_emu_blocks_per_sm(int block_size) {
  const int configured = gtopk::cuda_emu::GetSettings().blocks_per_sm;
  if (configured > 0) return configured;
  return 2048 / block_size < 32 ? 2048 / block_size : 32;
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return cudaErrorInvalidValue;
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return cudaErrorInvalidValue;
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return cudaErrorInvalidValue;
  if (device != 0) return cudaErrorInvalidDevice;
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof(prop->name),
                "gtopk CUDA emulator (CPU, %s order)",
                gtopk::cuda_emu::Order());
  prop->totalGlobalMem = gtopk::cuda_emu::GetSettings().memory_bytes;
  prop->multiProcessorCount = gtopk::cuda_emu::GetSettings().sms;
  prop->maxThreadsPerBlock = 1024;
  prop->warpSize = 32;
  prop->major = 9;
  prop->minor = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr,
                                   int device) {
  if (value == nullptr) return cudaErrorInvalidValue;
  if (device != 0) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = gtopk::cuda_emu::GetSettings().sms;
      return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = 1024;
      return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

cudaError_t cudaDeviceSynchronize() {
  std::lock_guard<std::mutex> lock(Mutex());
  gtopk::cuda_emu::Drain();
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  std::lock_guard<std::mutex> lock(Mutex());
  const cudaError_t e = gtopk::cuda_emu::t_last_error;
  gtopk::cuda_emu::t_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() {
  std::lock_guard<std::mutex> lock(Mutex());
  return gtopk::cuda_emu::t_last_error;
}

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer:
      return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection:
      return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer:
      return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
  }
  return "unknown error";
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(Mutex());
  return gtopk::cuda_emu::Allocate(ptr, bytes, /*pinned=*/false);
}

cudaError_t cudaFree(void* ptr) {
  std::lock_guard<std::mutex> lock(Mutex());
  return gtopk::cuda_emu::FreeAllocation(ptr, /*pinned=*/false);
}

cudaError_t cudaMallocHost(void** ptr, size_t bytes) {
  std::lock_guard<std::mutex> lock(Mutex());
  return gtopk::cuda_emu::Allocate(ptr, bytes, /*pinned=*/true);
}

cudaError_t cudaFreeHost(void* ptr) {
  std::lock_guard<std::mutex> lock(Mutex());
  return gtopk::cuda_emu::FreeAllocation(ptr, /*pinned=*/true);
}

namespace gtopk {
namespace cuda_emu {
namespace {

// A copy on `stream` with CUDA's host-side behaviour (CUDA runtime API,
// "API synchronization behavior"): from pageable host memory the source is
// staged before the call returns and the DMA to the device may still be
// pending (cudaMemcpy also synchronises the stream first; the Async form
// only may, and here does not, which leaves earlier work as late as
// possible); to pageable host memory the call returns once the copy is
// done; device-to-device, and to or from pinned memory in the Async form,
// nothing waits. `sync`: the cudaMemcpy form (legacy stream; pinned-to-
// device is synchronous there too).
void Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
          cudaStream_t stream, bool sync) {
  if (bytes == 0) return;
  switch (kind) {
    case cudaMemcpyHostToHost:
      SyncStream(stream);
      std::memmove(dst, src, bytes);
      return;
    case cudaMemcpyHostToDevice:
      if (!IsPinned(src, bytes)) {
        if (sync) SyncStream(stream);
        auto staged = std::make_shared<std::vector<char>>(
            static_cast<const char*>(src),
            static_cast<const char*>(src) + bytes);
        Enqueue(stream, [dst, staged]() {
          std::memcpy(dst, staged->data(), staged->size());
        });
        return;
      }
      break;
    case cudaMemcpyDeviceToHost:
      if (!IsPinned(dst, bytes)) {
        RunThrough(Enqueue(
            stream, [dst, src, bytes]() { std::memmove(dst, src, bytes); }));
        return;
      }
      break;
    default:
      break;
  }
  const uint64_t seq =
      Enqueue(stream, [dst, src, bytes]() { std::memmove(dst, src, bytes); });
  if (sync && kind != cudaMemcpyDeviceToDevice) RunThrough(seq);
}

}  // namespace
}  // namespace cuda_emu
}  // namespace gtopk

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes,
                       cudaMemcpyKind kind) {
  std::lock_guard<std::mutex> lock(Mutex());
  const cudaError_t e = gtopk::cuda_emu::CheckCopy(dst, src, bytes, &kind);
  if (e != cudaSuccess) return e;
  gtopk::cuda_emu::Copy(dst, src, bytes, kind, nullptr, /*sync=*/true);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes,
                            cudaMemcpyKind kind, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (!gtopk::cuda_emu::ValidStream(stream)) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidResourceHandle);
  }
  const cudaError_t e = gtopk::cuda_emu::CheckCopy(dst, src, bytes, &kind);
  if (e != cudaSuccess) return e;
  if (stream != nullptr && stream->capturing && bytes > 0 &&
      ((kind == cudaMemcpyDeviceToHost &&
        !gtopk::cuda_emu::IsPinned(dst, bytes)) ||
       (kind == cudaMemcpyHostToDevice &&
        !gtopk::cuda_emu::IsPinned(src, bytes)) ||
       kind == cudaMemcpyHostToHost)) {
    // Pageable host memory: the copy would have to finish (or be staged)
    // at the call, which a captured graph cannot do.
    stream->capture_invalidated = true;
    return gtopk::cuda_emu::SetError(cudaErrorStreamCaptureUnsupported);
  }
  gtopk::cuda_emu::Copy(dst, src, bytes, kind, stream, /*sync=*/false);
  return cudaSuccess;
}

// cudaMemset is asynchronous to the host for device memory (legacy
// stream), like cudaMemsetAsync.
cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  return cudaMemsetAsync(ptr, value, bytes, nullptr);
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes,
                            cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (!gtopk::cuda_emu::ValidStream(stream)) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidResourceHandle);
  }
  if (bytes == 0) return cudaSuccess;
  if (!gtopk::cuda_emu::InDevice(ptr, bytes, false)) {
    std::fprintf(stderr,
                 "gtopk CUDA emulator: cudaMemset(%p, %zu bytes): "
                 "not a device range\n",
                 ptr, bytes);
    return gtopk::cuda_emu::SetError(cudaErrorInvalidValue);
  }
  gtopk::cuda_emu::Enqueue(
      stream, [ptr, value, bytes]() { std::memset(ptr, value, bytes); });
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream,
                                      unsigned int flags) {
  if (stream == nullptr) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(Mutex());
  auto* s = new CUstream_st;
  s->flags = flags;
  S().streams.insert(s);
  *stream = s;
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (stream == nullptr || S().streams.erase(stream) == 0) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidResourceHandle);
  }
  // CUDA releases it once its work is done; nothing queued may outlive it.
  gtopk::cuda_emu::SyncStream(stream);
  delete stream;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (!gtopk::cuda_emu::ValidStream(stream)) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidResourceHandle);
  }
  if (stream != nullptr && stream->capturing) {
    stream->capture_invalidated = true;
    return gtopk::cuda_emu::SetError(cudaErrorStreamCaptureUnsupported);
  }
  gtopk::cuda_emu::SyncStream(stream);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  if (event == nullptr) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(Mutex());
  *event = new CUevent_st;
  S().events.insert(*event);
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (S().events.erase(event) == 0) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidResourceHandle);
  }
  // Every record still queued (an earlier one may be on another stream)
  // refers to the event.
  gtopk::cuda_emu::Drain();
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (S().events.count(event) == 0 || !gtopk::cuda_emu::ValidStream(stream)) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidResourceHandle);
  }
  event->recorded = true;
  event->done = false;
  const uint64_t generation = ++event->generation;
  event->seq = gtopk::cuda_emu::Enqueue(stream, [event, generation]() {
    if (event->generation != generation) return;  // re-recorded since
    event->time = std::chrono::steady_clock::now();
    event->done = true;
  });
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (S().events.count(event) == 0) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidResourceHandle);
  }
  if (event->recorded) gtopk::cuda_emu::RunThrough(event->seq);
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event,
                                unsigned int flags) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (S().events.count(event) == 0 || !gtopk::cuda_emu::ValidStream(stream)) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidResourceHandle);
  }
  if (flags != 0) return gtopk::cuda_emu::SetError(cudaErrorInvalidValue);
  if (!event->recorded) return cudaSuccess;
  // A dependency of what follows on `stream`: when this operation runs (in
  // order on its stream), the record and what it depends on run first,
  // unless they ran already.
  const uint64_t seq = event->seq;
  gtopk::cuda_emu::Enqueue(stream,
                           [seq]() { gtopk::cuda_emu::RunThrough(seq); });
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start,
                                 cudaEvent_t end) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (ms == nullptr) return cudaErrorInvalidValue;
  if (S().events.count(start) == 0 || S().events.count(end) == 0) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidResourceHandle);
  }
  if (!start->done || !end->done) return cudaErrorNotReady;
  *ms =
      std::chrono::duration<float, std::milli>(end->time - start->time).count();
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream,
                                   cudaStreamCaptureMode mode) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (!gtopk::cuda_emu::ValidStream(stream)) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidResourceHandle);
  }
  if (mode != cudaStreamCaptureModeGlobal &&
      mode != cudaStreamCaptureModeThreadLocal &&
      mode != cudaStreamCaptureModeRelaxed) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidValue);
  }
  if (stream == nullptr) {  // the legacy default stream cannot capture
    return gtopk::cuda_emu::SetError(cudaErrorStreamCaptureUnsupported);
  }
  if (stream->capturing)
    return gtopk::cuda_emu::SetError(cudaErrorInvalidValue);
  stream->capturing = true;
  stream->capture_invalidated = false;
  stream->captured.clear();
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (graph == nullptr) return gtopk::cuda_emu::SetError(cudaErrorInvalidValue);
  if (stream == nullptr || !gtopk::cuda_emu::ValidStream(stream) ||
      !stream->capturing) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidValue);
  }
  stream->capturing = false;
  std::vector<std::function<void()>> ops = std::move(stream->captured);
  stream->captured.clear();
  if (stream->capture_invalidated) {
    *graph = nullptr;
    return gtopk::cuda_emu::SetError(cudaErrorStreamCaptureInvalidated);
  }
  *graph = new CUgraph_st{std::move(ops)};
  return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                 unsigned long long flags) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (exec == nullptr || graph == nullptr || flags != 0) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidValue);
  }
  *exec = new CUgraphExec_st{graph->ops};
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (exec == nullptr) return gtopk::cuda_emu::SetError(cudaErrorInvalidValue);
  if (!gtopk::cuda_emu::ValidStream(stream)) {
    return gtopk::cuda_emu::SetError(cudaErrorInvalidResourceHandle);
  }
  for (const auto& op : exec->ops) gtopk::cuda_emu::Enqueue(stream, op);
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (graph == nullptr) return gtopk::cuda_emu::SetError(cudaErrorInvalidValue);
  delete graph;
  return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  std::lock_guard<std::mutex> lock(Mutex());
  if (exec == nullptr) return gtopk::cuda_emu::SetError(cudaErrorInvalidValue);
  // Launched copies of its work are queued by value; they may still run.
  delete exec;
  return cudaSuccess;
}
