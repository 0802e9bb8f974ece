// Asynchronous file I/O engine for NVMe offload: a pool of worker threads doing pread/pwrite.
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

struct AioRequest;

struct AioTask {
  std::shared_ptr<AioRequest> request;
  int64_t first_block;
  int64_t block_count;
};

class AioEngine {
 public:
  AioEngine(int64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
            int thread_count, bool use_direct);
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

 private:
  void worker_loop();
  void run_task(const AioTask& task);

  const int64_t block_size_;
  const int queue_depth_;
  const bool single_submit_;
  const bool overlap_events_;
  const bool use_direct_;

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
