// See aio_engine.h.
#include "aio_engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace zero_ops {

namespace {

std::string describe(const char* what, int64_t nbytes, int64_t offset, const std::string& path) {
  return std::string(what) + " " + std::to_string(nbytes) + " bytes at offset " +
         std::to_string(offset) + " of '" + path + "'";
}

}  // namespace

AioRequest::~AioRequest() {
  if (fd_buffered >= 0) ::close(fd_buffered);
  if (fd_direct >= 0) ::close(fd_direct);
}

void AioRequest::fail(int e, const std::string& msg) {
  std::lock_guard<std::mutex> lock(mu);
  if (error.empty()) {
    err = e;
    error = msg;
  }
}

bool AioRequest::failed() {
  std::lock_guard<std::mutex> lock(mu);
  return !error.empty();
}

AioRequest::Block AioRequest::block(int64_t b) const {
  const int64_t start = b * block_size;
  const int64_t len = std::min(block_size, nbytes - start);
  char* buf = buffer + start;
  const int64_t file_off = offset + start;
  const bool aligned = reinterpret_cast<uintptr_t>(buf) % kDirectAlignment == 0 &&
                       file_off % kDirectAlignment == 0 && len % kDirectAlignment == 0;
  const bool direct = aligned && fd_direct >= 0;
  return Block{buf, file_off, len, direct ? fd_direct : fd_buffered, direct};
}

int64_t AioRequest::run_length(int64_t b, int64_t end, int64_t max_blocks) const {
  const bool direct = block(b).direct;
  if (is_write && !direct) return 1;  // See [Note: runs of blocks]: buffered writes stay per block.
  int64_t n = 1;
  while (n < max_blocks && b + n < end && block(b + n).direct == direct) ++n;
  return n;
}

int64_t AioRequest::transfer_run(int64_t b, int64_t end, int64_t max_blocks,
                                 std::atomic<int64_t>& direct_bytes, std::atomic<int64_t>& buffered_bytes) {
  const int64_t n = run_length(b, end, max_blocks);
  const Block first = block(b);
  const Block last = block(b + n - 1);
  const int64_t len = last.file_off + last.len - first.file_off;
  if (!transfer_sync(first.fd, first.buf, len, first.file_off)) return 0;
  (first.direct ? direct_bytes : buffered_bytes) += len;
  return n;
}

bool AioRequest::transfer_sync(int fd, char* buf, int64_t len, int64_t file_off) {
  int64_t done = 0;
  while (done < len) {
    const ssize_t n = is_write ? ::pwrite(fd, buf + done, len - done, file_off + done)
                               : ::pread(fd, buf + done, len - done, file_off + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      fail(e, std::string(is_write ? "write" : "read") + " failed: " +
                  describe(is_write ? "writing" : "reading", len - done, file_off + done, path) + ": " +
                  std::strerror(e));
      return false;
    }
    if (n == 0) {
      if (is_write) {
        fail(ENOSPC, "write made no progress: " + describe("writing", len - done, file_off + done, path));
      } else {
        fail(EIO, "short read: " + describe("expected", nbytes, offset, path) + ", the file ended at byte " +
                      std::to_string(file_off + done));
      }
      return false;
    }
    done += n;
  }
  return true;
}

AioEngine::AioEngine(int64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
                     int thread_count, bool use_direct, const std::string& engine)
    : block_size_(block_size),
      queue_depth_(queue_depth),
      single_submit_(single_submit),
      overlap_events_(overlap_events),
      use_direct_(use_direct),
      thread_count_(thread_count) {
  if (block_size <= 0 || queue_depth <= 0 || thread_count <= 0) {
    throw std::invalid_argument("block_size, queue_depth and thread_count must be positive");
  }
  if (engine != "auto" && engine != "libaio" && engine != "threads") {
    throw std::invalid_argument("engine must be 'auto', 'libaio' or 'threads', got '" + engine + "'");
  }
  if (engine == "libaio" || (engine == "auto" && LibaioQueue::compiled())) {
    // See [Note: aio backends]: "auto" quietly stays on threads when kernel AIO is refused here.
    try {
      for (int i = 0; i < thread_count; ++i) queues_.push_back(std::make_unique<LibaioQueue>(queue_depth));
      backend_ = AioBackend::kLibaio;
    } catch (const IoError&) {
      queues_.clear();
      if (engine == "libaio") throw;
    }
  }
  workers_.reserve(thread_count);
  for (int i = 0; i < thread_count; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

AioEngine::~AioEngine() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Never free the engine under in-flight transfers into caller memory.
    done_cv_.wait(lock, [this] { return blocks_outstanding_ == 0; });
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void AioEngine::submit(bool is_write, const std::string& path, uintptr_t buffer, int64_t nbytes,
                       int64_t offset) {
  if (nbytes < 0 || offset < 0) throw std::invalid_argument("nbytes and offset must be >= 0");
  auto req = std::make_shared<AioRequest>();
  req->is_write = is_write;
  req->path = path;
  req->buffer = reinterpret_cast<char*>(buffer);
  req->nbytes = nbytes;
  req->offset = offset;
  req->block_size = block_size_;
  const int flags = is_write ? (O_WRONLY | O_CREAT) : O_RDONLY;
  req->fd_buffered = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
  if (req->fd_buffered < 0) {
    const int e = errno;
    throw IoError(e, std::string("cannot open '") + path + "' for " + (is_write ? "writing" : "reading") +
                         ": " + std::strerror(e), path);
  }
  if (!is_write) {
    struct stat st;
    if (::fstat(req->fd_buffered, &st) == 0 && S_ISREG(st.st_mode) && st.st_size < offset + nbytes) {
      throw IoError(EIO, "short read: " + describe("cannot read", nbytes, offset, path) +
                             ": the file has only " + std::to_string(st.st_size) + " bytes", path);
    }
  }
#ifdef O_DIRECT
  if (use_direct_) {
    // EINVAL here means the file system (tmpfs, some FUSE) refuses O_DIRECT: stay buffered.
    req->fd_direct = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0644);
  }
#endif
  // Only O_DIRECT writes run asynchronously in the kernel; buffered ones complete in io_submit.
  if (is_write && backend_ == AioBackend::kLibaio && req->fd_direct >= 0 && nbytes > 0) reserve_for_write(*req);
#ifdef POSIX_FADV_SEQUENTIAL
  // See [Note: buffered read readahead]. A hint only: its failure changes nothing.
  if (!is_write && nbytes > 0) ::posix_fadvise(req->fd_buffered, offset, nbytes, POSIX_FADV_SEQUENTIAL);
#endif
  const int64_t blocks = nbytes == 0 ? 0 : (nbytes + block_size_ - 1) / block_size_;
  // A threads task takes queue_depth consecutive blocks (one with single_submit) and moves each
  // run of them in one call (see [Note: runs of blocks]).
  // With libaio a worker keeps its own queue_depth blocks in flight, so it claims an even share
  // of the request (at least queue_depth blocks) to keep that window full.
  const int64_t per_task =
      backend_ == AioBackend::kLibaio
          ? std::max<int64_t>(queue_depth_, (blocks + thread_count_ - 1) / thread_count_)
          : (single_submit_ ? 1 : queue_depth_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++requests_since_wait_;
    for (int64_t b = 0; b < blocks; b += per_task) {
      queue_.push_back(AioTask{req, b, std::min(per_task, blocks - b)});
    }
    blocks_outstanding_ += (blocks + per_task - 1) / per_task;
  }
  work_cv_.notify_all();
}

// ext4 (and others) complete kernel-AIO O_DIRECT writes that extend the file synchronously inside
// io_submit, which serialises a whole queue behind each block. Reserving the range first
// (fallocate, else a sparse ftruncate) makes every block an in-size write the kernel runs
// asynchronously. The final size is what the write would produce anyway; ENOSPC is reported
// here, before anything is queued.
void AioEngine::reserve_for_write(const AioRequest& r) {
  struct stat st;
  if (::fstat(r.fd_buffered, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size >= r.offset + r.nbytes) return;
#ifdef __linux__
  if (::fallocate(r.fd_buffered, 0, r.offset, r.nbytes) == 0) return;
  const int e = errno;
  if (e == ENOSPC || e == EDQUOT) {
    throw IoError(e, "cannot reserve " + std::to_string(r.nbytes) + " bytes at offset " + std::to_string(r.offset) +
                         " of '" + r.path + "': " + std::strerror(e), r.path);
  }
#endif
  if (::ftruncate(r.fd_buffered, r.offset + r.nbytes) != 0) return;  // the writes will report it
}

void AioEngine::worker_loop(int index) {
  for (;;) {
    AioTask task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    if (backend_ == AioBackend::kLibaio) {
      if (!task.request->failed()) {
        queues_[index]->run(*task.request, task.first_block, task.block_count, single_submit_,
                            overlap_events_, direct_bytes_, buffered_bytes_);
      }
    } else {
      run_task(task);
    }
    std::shared_ptr<AioRequest> failed;
    {
      std::lock_guard<std::mutex> lock(task.request->mu);
      if (!task.request->error.empty()) failed = task.request;
    }
    task.request.reset();  // close fds promptly once the last block is done
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed && std::find(failed_.begin(), failed_.end(), failed) == failed_.end()) {
        failed_.push_back(failed);
      }
      if (--blocks_outstanding_ == 0) done_cv_.notify_all();
    }
  }
}

void AioEngine::run_task(const AioTask& task) {
  AioRequest& r = *task.request;
  const int64_t end = task.first_block + task.block_count;
  for (int64_t b = task.first_block; b < end;) {
    if (r.failed()) return;  // the request already failed; skip its remaining blocks
    // See [Note: runs of blocks]; the task holds at most queue_depth blocks.
    const int64_t moved = r.transfer_run(b, end, task.block_count, direct_bytes_, buffered_bytes_);
    if (moved == 0) return;
    b += moved;
  }
}

int64_t AioEngine::wait() {
  std::vector<std::shared_ptr<AioRequest>> failed;
  int64_t completed;
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [this] { return blocks_outstanding_ == 0; });
    completed = requests_since_wait_;
    requests_since_wait_ = 0;
    failed.swap(failed_);
  }
  if (!failed.empty()) {
    AioRequest& r = *failed.front();
    std::string msg = r.error;
    if (failed.size() > 1) msg += " (and " + std::to_string(failed.size() - 1) + " more failed requests)";
    throw IoError(r.err, msg, r.path);
  }
  return completed;
}

int64_t AioEngine::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return requests_since_wait_;
}

}  // namespace zero_ops
