// Asynchronous file I/O engine for NVMe offload: a pool of worker threads that either do
// pread/pwrite themselves ("threads" backend) or each drive a Linux kernel AIO queue ("libaio"
// backend, compiled when <libaio.h> is found at build time). See [Note: aio backends].
//
// A request (one tensor <-> one file range) is split into `block_size` blocks that the workers
// transfer in parallel. Blocks whose buffer address, file offset and length are all multiples
// of kDirectAlignment go through an O_DIRECT descriptor (no page-cache copy) when the file
// system accepts O_DIRECT; everything else (tails, unaligned buffers, tmpfs) goes through a
// buffered descriptor. Errors are recorded per request with the path and re-raised by wait():
// a short read is an error, never silently accepted.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace zero_ops {

constexpr int64_t kDirectAlignment = 4096;

// An I/O failure: errno (0 when not from a syscall) + message naming the path.
class IoError : public std::runtime_error {
 public:
  IoError(int err, const std::string& msg, std::string path)
      : std::runtime_error(msg), err_(err), path_(std::move(path)) {}
  int err() const { return err_; }
  const std::string& path() const { return path_; }

 private:
  int err_;
  std::string path_;
};

// [Note: aio backends]
// threads: each worker claims queue_depth consecutive blocks (1 with single_submit) and moves
//   each run of them that shares a descriptor with ONE blocking pread/pwrite (see [Note: runs of
//   blocks]); parallelism = thread_count. overlap_events has no effect (there are no completion
//   events to overlap).
// libaio: each worker owns an io_context of queue_depth slots and claims a contiguous share of a
//   request's blocks. It keeps up to queue_depth O_DIRECT blocks in flight in the kernel: with
//   overlap_events a completed slot is refilled at once (a sliding window); without it the
//   worker submits a batch of queue_depth, waits for all of it, then submits the next batch
//   (DeepSpeed's two modes). single_submit issues one io_submit call per block instead of one per
//   batch. Buffered blocks would complete synchronously inside io_submit anyway, so the worker
//   moves them itself, a run of up to queue_depth blocks per call, like the threads backend.
// "auto" picks libaio when it was compiled in and io_setup works here (containers may forbid
// it), else threads; AioEngine::backend() says which one runs.
//
// [Note: runs of blocks]
// Consecutive blocks of a request are contiguous both in memory and in the file, so a run of
// blocks that all go through the same descriptor is moved with one system call of up to
// queue_depth * block_size bytes. For O_DIRECT this hands the block layer queue_depth blocks at
// once, which it splits into device requests that are in flight together: a single thread gets
// the queue depth libaio gets from its window (one 1 MiB pread at a time leaves the device idle
// between calls: threads backend, 1 thread, 256 MiB O_DIRECT read, same run: 0.68 of dd with one
// block per call, 0.86 with runs of 8; libaio 0.92). For buffered reads it cuts
// the per-call overhead. Buffered writes stay one block per call: 8 MiB pwrites (plus fsync)
// measured 0.58-0.69 of dd's throughput where 1 MiB ones reached 0.88-0.95, same run.
// single_submit keeps one block per call everywhere.
//
// [Note: buffered read readahead]
// A buffered read that misses the page cache waits for the device; the kernel's readahead hides
// that only while it sees a sequential stream, and the workers of a request read through one
// shared file description (one readahead state): two workers reading interleaved runs looked
// random enough to shrink readahead (threads backend, 2 workers, cold cache: 0.80 of dd). Reads
// therefore mark the request's descriptor POSIX_FADV_SEQUENTIAL (Linux doubles its readahead
// window; measured 1.08 of dd for the same case). A hint only: a failure changes nothing.
// Also measured and rejected: POSIX_FADV_WILLNEED on the next run before each read (0.21 s vs
// 0.15 s best case for 256 MiB, the hint itself blocks while it submits the I/O).

enum class AioBackend { kThreads, kLibaio };

// One tensor <-> file range transfer. Owns its file descriptors; they close when the last
// block finishes (the shared_ptr held by the tasks goes away).
struct AioRequest {
  bool is_write = false;
  std::string path;
  char* buffer = nullptr;
  int64_t nbytes = 0;
  int64_t offset = 0;
  int64_t block_size = 0;
  int fd_buffered = -1;
  int fd_direct = -1;  // -1 when O_DIRECT is unavailable for this file
  std::mutex mu;
  int err = 0;
  std::string error;  // first failure, empty when none

  ~AioRequest();
  void fail(int e, const std::string& msg);
  bool failed();

  // Geometry of block b: buffer, file offset, length and the descriptor to use (O_DIRECT when
  // buffer, offset and length are all aligned and the file system accepted O_DIRECT).
  struct Block {
    char* buf;
    int64_t file_off;
    int64_t len;
    int fd;
    bool direct;
  };
  Block block(int64_t b) const;
  // How many blocks from b on (at most max_blocks, never past end) go through the same
  // descriptor as b; always 1 for buffered writes. See [Note: runs of blocks].
  int64_t run_length(int64_t b, int64_t end, int64_t max_blocks) const;
  // Moves the run [b, b + run_length(b, end, max_blocks)) with one blocking call. Returns the
  // number of blocks moved, 0 on failure (recorded). Adds the bytes to direct_bytes or
  // buffered_bytes.
  int64_t transfer_run(int64_t b, int64_t end, int64_t max_blocks, std::atomic<int64_t>& direct_bytes,
                       std::atomic<int64_t>& buffered_bytes);
  // Blocking pread/pwrite of [buf, buf+len) at file_off until done; records a failure (with
  // the path) and returns false on error, EOF (short read) or no progress (disk full).
  bool transfer_sync(int fd, char* buf, int64_t len, int64_t file_off);
};

// A kernel AIO queue of `depth` slots (libaio), owned by one worker thread.
class LibaioQueue {
 public:
  explicit LibaioQueue(int depth);  // throws IoError when io_setup fails or libaio is absent
  ~LibaioQueue();
  LibaioQueue(const LibaioQueue&) = delete;
  LibaioQueue& operator=(const LibaioQueue&) = delete;
  // Moves blocks [first, first + count) of r; calls on_bytes(direct, nbytes) per finished block.
  void run(AioRequest& r, int64_t first, int64_t count, bool single_submit, bool overlap_events,
           std::atomic<int64_t>& direct_bytes, std::atomic<int64_t>& buffered_bytes);

  static bool compiled();
  // '' when a kernel AIO context can be created here, else why not.
  static std::string probe();

 private:
  void* ctx_ = nullptr;  // io_context_t
  int depth_;
};

struct AioTask {
  std::shared_ptr<AioRequest> request;
  int64_t first_block;
  int64_t block_count;
};

class AioEngine {
 public:
  // engine: "auto", "libaio" or "threads" (see [Note: aio backends]).
  AioEngine(int64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
            int thread_count, bool use_direct, const std::string& engine = "auto");
  ~AioEngine();
  AioEngine(const AioEngine&) = delete;
  AioEngine& operator=(const AioEngine&) = delete;

  // Queues a transfer; returns at once. Opening the file happens here, so a missing path or a
  // read past the end of the file raises immediately.
  void submit(bool is_write, const std::string& path, uintptr_t buffer, int64_t nbytes,
              int64_t offset);
  // Blocks until every queued transfer is finished. Returns how many requests completed since
  // the last wait(); throws IoError (the first failure) if any of them failed.
  int64_t wait();
  // Number of requests submitted and not yet collected by wait().
  int64_t pending() const;

  // How many bytes went through O_DIRECT / buffered descriptors (for tests and reports).
  int64_t direct_bytes() const { return direct_bytes_.load(); }
  int64_t buffered_bytes() const { return buffered_bytes_.load(); }
  // "libaio" or "threads": the backend this engine runs on.
  std::string backend() const { return backend_ == AioBackend::kLibaio ? "libaio" : "threads"; }

 private:
  void worker_loop(int index);
  void reserve_for_write(const AioRequest& r);
  void run_task(const AioTask& task);

  const int64_t block_size_;
  const int queue_depth_;
  const bool single_submit_;
  const bool overlap_events_;
  const bool use_direct_;
  const int thread_count_;
  AioBackend backend_ = AioBackend::kThreads;
  std::vector<std::unique_ptr<LibaioQueue>> queues_;  // one per worker with the libaio backend

  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<AioTask> queue_;
  int64_t blocks_outstanding_ = 0;
  int64_t requests_since_wait_ = 0;
  std::vector<std::shared_ptr<AioRequest>> failed_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
  std::atomic<int64_t> direct_bytes_{0};
  std::atomic<int64_t> buffered_bytes_{0};
};

}  // namespace zero_ops
