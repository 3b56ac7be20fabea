// An LD_PRELOAD library that counts a process's live heap blocks by the thread that allocated
// them and by size, and writes the counts every LIVE_EVERY seconds (docs/soak.md, "Whose
// blocks"). It answers what RSS and mallinfo cannot: whether memory that grows is live data (a
// leak, and whose) or memory the allocator keeps (free chunks, thread caches, arena tops).
//
//   LD_PRELOAD=build/lib/libgradcomp_live_alloc.so LIVE_EVERY=20 LIVE_DIR=/tmp/live <command>
//   /usr/bin/python3 bench/soak/live_alloc_report.py /tmp/live
//
// Each dump is LIVE_DIR/<pid>.<n>.txt (LIVE_DIR must exist; default /tmp), with the lines
//   T <tid> <thread name> <live bytes> <live blocks>    one per thread that ever allocated
//   S <tid> <size> <live blocks>                        one per thread and size with blocks
// A dump is written by the allocating call that finds LIVE_EVERY seconds passed, so an idle
// process writes none. Blocks are found by address in an open-addressing table reserved with
// mmap (so that the counting allocates nothing through malloc itself), under one spin lock:
// slow, for diagnosis only. glibc only: it calls glibc's own __libc_* allocators.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

extern void* __libc_malloc(size_t);
extern void __libc_free(void*);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);

enum { kBlockSlots = 1 << 22, kSizeSlots = 1 << 18, kThreads = 512 };

typedef struct { uintptr_t address; uint32_t size; uint32_t thread; } Block;
typedef struct { uint64_t key; int64_t count; } SizeCount;  // key: (thread + 1) << 40 | size

static Block* blocks;
static SizeCount* sizes;
static int thread_ids[kThreads];
static int64_t thread_bytes[kThreads], thread_blocks[kThreads];
static atomic_flag lock = ATOMIC_FLAG_INIT;
static __thread int my_thread = -1;
static __thread int counting;  // set while this thread counts: what a dump allocates is not
static double every, last_dump;
static int dumps;
static const char* dir = "/tmp";

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void* reserve(size_t bytes) {
  void* p = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  return p == MAP_FAILED ? 0 : p;
}

static int start(void) {
  if (blocks) return 1;
  blocks = reserve(sizeof(Block) * kBlockSlots);
  sizes = reserve(sizeof(SizeCount) * kSizeSlots);
  if (!blocks || !sizes) return 0;
  const char* e = getenv("LIVE_EVERY");
  if (e) every = atof(e);
  const char* d = getenv("LIVE_DIR");
  if (d) dir = d;
  last_dump = now();
  return 1;
}

static uint32_t home(uintptr_t address) {
  return (uint32_t)(((address >> 4) * 0x9E3779B97F4A7C15ull) >> 40) & (kBlockSlots - 1);
}

static int this_thread(void) {
  if (my_thread >= 0) return my_thread;
  int tid = (int)syscall(SYS_gettid);
  for (int i = 0; i < kThreads - 1; i++) {
    if (thread_ids[i] == tid || thread_ids[i] == 0) {
      thread_ids[i] = tid;
      return my_thread = i;
    }
  }
  return my_thread = kThreads - 1;  // the rest share the last slot
}

static void count_size(uint32_t thread, uint32_t size, int delta) {
  uint64_t key = ((uint64_t)(thread + 1) << 40) | size;
  uint32_t i = (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> 40) & (kSizeSlots - 1);
  while (sizes[i].key && sizes[i].key != key) i = (i + 1) & (kSizeSlots - 1);
  sizes[i].key = key;
  sizes[i].count += delta;
}

static void write_dump(void) {
  char path[512], line[512];
  snprintf(path, sizeof path, "%s/%d.%04d.txt", dir, getpid(), dumps++);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  for (int i = 0; i < kThreads && thread_ids[i]; i++) {
    char comm_path[64], name[32] = "?";
    snprintf(comm_path, sizeof comm_path, "/proc/self/task/%d/comm", thread_ids[i]);
    int c = open(comm_path, O_RDONLY);
    if (c >= 0) {
      ssize_t n = read(c, name, sizeof name - 1);
      name[n > 0 ? n - 1 : 0] = 0;  // without the newline
      close(c);
    }
    int n = snprintf(line, sizeof line, "T %d %s %lld %lld\n", thread_ids[i],
                     name[0] ? name : "?", (long long)thread_bytes[i],
                     (long long)thread_blocks[i]);
    if (write(fd, line, (size_t)n) != n) break;
  }
  for (uint32_t i = 0; i < kSizeSlots; i++) {
    if (!sizes[i].key || !sizes[i].count) continue;
    int tid = thread_ids[(sizes[i].key >> 40) - 1];
    unsigned long long size = sizes[i].key & 0xffffffffffull;
    int n = snprintf(line, sizeof line, "S %d %llu %lld\n", tid, size, (long long)sizes[i].count);
    if (write(fd, line, (size_t)n) != n) break;
  }
  close(fd);
}

static void added(void* p, size_t size) {
  if (!p || counting) return;
  counting = 1;
  while (atomic_flag_test_and_set(&lock)) {}
  if (start()) {
    uint32_t thread = (uint32_t)this_thread(), i = home((uintptr_t)p);
    while (blocks[i].address) i = (i + 1) & (kBlockSlots - 1);
    blocks[i] = (Block){(uintptr_t)p, size > UINT32_MAX ? UINT32_MAX : (uint32_t)size, thread};
    thread_bytes[thread] += blocks[i].size;
    thread_blocks[thread]++;
    count_size(thread, blocks[i].size, 1);
    if (every > 0 && now() - last_dump >= every) {
      last_dump = now();
      write_dump();
    }
  }
  atomic_flag_clear(&lock);
  counting = 0;
}

// Linear probing with backward-shift deletion: the entries after a removed one move up when
// their home slot allows it, so lookups never need tombstones.
static void removed(void* p) {
  if (!p || !blocks) return;
  while (atomic_flag_test_and_set(&lock)) {}
  uint32_t i = home((uintptr_t)p);
  while (blocks[i].address && blocks[i].address != (uintptr_t)p) i = (i + 1) & (kBlockSlots - 1);
  if (blocks[i].address) {  // blocks from before the library started are not counted
    Block b = blocks[i];
    thread_bytes[b.thread] -= b.size;
    thread_blocks[b.thread]--;
    count_size(b.thread, b.size, -1);
    for (uint32_t j = i;;) {
      j = (j + 1) & (kBlockSlots - 1);
      if (!blocks[j].address) break;
      uint32_t k = home(blocks[j].address);
      int k_between = i <= j ? (i < k && k <= j) : (i < k || k <= j);
      if (!k_between) {
        blocks[i] = blocks[j];
        i = j;
      }
    }
    blocks[i].address = 0;
  }
  atomic_flag_clear(&lock);
}

void* malloc(size_t n) {
  void* p = __libc_malloc(n);
  added(p, n);
  return p;
}
void free(void* p) {
  removed(p);
  __libc_free(p);
}
void* calloc(size_t count, size_t size) {
  void* p = __libc_calloc(count, size);
  added(p, count * size);
  return p;
}
void* realloc(void* old, size_t n) {
  removed(old);
  void* p = __libc_realloc(old, n);
  if (p) added(p, n);
  else if (old && n) added(old, n);  // failed: the old block stays live
  return p;
}
void* memalign(size_t alignment, size_t n) {
  void* p = __libc_memalign(alignment, n);
  added(p, n);
  return p;
}
void* aligned_alloc(size_t alignment, size_t n) { return memalign(alignment, n); }
int posix_memalign(void** out, size_t alignment, size_t n) {
  void* p = memalign(alignment, n);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
void* valloc(size_t n) { return memalign(4096, n); }
void* pvalloc(size_t n) { return memalign(4096, (n + 4095) & ~(size_t)4095); }
