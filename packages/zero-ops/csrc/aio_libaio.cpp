// Kernel AIO (libaio) queue of the async I/O engine. See [Note: aio backends] in aio_engine.h.
//
// Compiled with -DZERO_OPS_HAVE_LIBAIO and linked with -laio only when the build finds
// <libaio.h>; otherwise LibaioQueue::compiled() is false and constructing one throws, so the
// engine stays on its thread-pool backend.
#include <cerrno>
#include <cstring>
#include <vector>

#include "aio_engine.h"

#ifdef ZERO_OPS_HAVE_LIBAIO
#include <libaio.h>
#endif

namespace zero_ops {

#ifdef ZERO_OPS_HAVE_LIBAIO

namespace {

io_context_t as_ctx(void* p) { return static_cast<io_context_t>(p); }

// One slot of the window: its control block and which block of the request it moves.
struct Slot {
  struct iocb cb;
  int64_t block;
};

}  // namespace

bool LibaioQueue::compiled() { return true; }

std::string LibaioQueue::probe() {
  io_context_t ctx = nullptr;
  const int rc = io_setup(1, &ctx);
  if (rc != 0) return std::string("io_setup failed: ") + std::strerror(-rc);
  io_destroy(ctx);
  return "";
}

LibaioQueue::LibaioQueue(int depth) : depth_(depth) {
  io_context_t ctx = nullptr;
  const int rc = io_setup(depth, &ctx);
  if (rc != 0) {
    throw IoError(-rc, std::string("io_setup(") + std::to_string(depth) + ") failed: " + std::strerror(-rc) +
                           " (kernel AIO unavailable; raise /proc/sys/fs/aio-max-nr or use the threads engine)",
                  "");
  }
  ctx_ = ctx;
}

LibaioQueue::~LibaioQueue() {
  if (ctx_ != nullptr) io_destroy(as_ctx(ctx_));
}

void LibaioQueue::run(AioRequest& r, int64_t first, int64_t count, bool single_submit,
                      bool overlap_events, std::atomic<int64_t>& direct_bytes,
                      std::atomic<int64_t>& buffered_bytes) {
  std::vector<Slot> slots(depth_);
  std::vector<int> free_slots;
  for (int i = depth_ - 1; i >= 0; --i) free_slots.push_back(i);
  std::vector<struct iocb*> batch;
  std::vector<struct io_event> events(depth_);
  int64_t next = first;
  const int64_t end = first + count;
  int inflight = 0;
  bool stop = false;  // a failure: submit nothing more, but drain what the kernel holds

  // Submits `n` control blocks, retrying the remainder of a partial io_submit.
  auto submit = [&](struct iocb** cbs, int n) -> bool {
    int done = 0;
    while (done < n) {
      const int rc = io_submit(as_ctx(ctx_), n - done, cbs + done);
      if (rc == -EINTR || rc == -EAGAIN) continue;
      if (rc == -EINVAL) {
        // The file does not support kernel AIO (a character device, some FUSE file systems):
        // move this block synchronously on the buffered descriptor and carry on.
        Slot* slot = static_cast<Slot*>(cbs[done]->data);
        const AioRequest::Block blk = r.block(slot->block);
        free_slots.push_back(static_cast<int>(slot - slots.data()));
        ++done;
        if (!r.transfer_sync(r.fd_buffered, blk.buf, blk.len, blk.file_off)) {
          for (int i = done; i < n; ++i) {
            free_slots.push_back(static_cast<int>(static_cast<Slot*>(cbs[i]->data) - slots.data()));
          }
          return false;
        }
        buffered_bytes += blk.len;
        continue;
      }
      if (rc < 0) {
        r.fail(-rc, std::string("io_submit failed for '") + r.path + "': " + std::strerror(-rc));
        // Slots not accepted by the kernel go back to the free list.
        for (int i = done; i < n; ++i) {
          free_slots.push_back(static_cast<int>(static_cast<Slot*>(cbs[i]->data) - slots.data()));
        }
        return false;
      }
      done += rc;
      inflight += rc;
    }
    return true;
  };

  while (true) {
    // Fill the window: always when overlapping events, otherwise only once it has drained.
    if (!stop && next < end && (overlap_events || inflight == 0)) {
      batch.clear();
      while (!free_slots.empty() && next < end) {
        const AioRequest::Block blk = r.block(next);
        if (!blk.direct && !single_submit) {
          // Buffered blocks would complete synchronously inside io_submit: move a run of them
          // with one call instead (see [Note: aio backends] and [Note: runs of blocks]).
          const int64_t moved = r.transfer_run(next, end, depth_, direct_bytes, buffered_bytes);
          if (moved == 0) {
            stop = true;
            break;
          }
          next += moved;
          continue;
        }
        const int s = free_slots.back();
        free_slots.pop_back();
        Slot& slot = slots[s];
        slot.block = next++;
        if (r.is_write) {
          io_prep_pwrite(&slot.cb, blk.fd, blk.buf, blk.len, blk.file_off);
        } else {
          io_prep_pread(&slot.cb, blk.fd, blk.buf, blk.len, blk.file_off);
        }
        slot.cb.data = &slot;
        if (single_submit) {
          struct iocb* one = &slot.cb;
          if (!submit(&one, 1)) {
            stop = true;
            break;
          }
        } else {
          batch.push_back(&slot.cb);
        }
      }
      if (!batch.empty() && !submit(batch.data(), static_cast<int>(batch.size()))) stop = true;
    }
    if (inflight == 0) break;
    // Overlapping: reap whatever is done (at least one) and refill; batched: reap the whole batch.
    const int min_nr = overlap_events ? 1 : inflight;
    const int got = io_getevents(as_ctx(ctx_), min_nr, depth_, events.data(), nullptr);
    if (got == -EINTR) continue;
    if (got < 0) {
      // Cannot reap: the buffers may still be in use by the kernel, so this is fatal for them.
      r.fail(-got, std::string("io_getevents failed for '") + r.path + "': " + std::strerror(-got));
      io_destroy(as_ctx(ctx_));  // cancels/waits for outstanding requests before returning
      io_context_t ctx = nullptr;
      ctx_ = io_setup(depth_, &ctx) == 0 ? ctx : nullptr;
      return;
    }
    for (int i = 0; i < got; ++i) {
      Slot* slot = static_cast<Slot*>(events[i].data);
      --inflight;
      free_slots.push_back(static_cast<int>(slot - slots.data()));
      if (stop) continue;
      const AioRequest::Block blk = r.block(slot->block);
      const long res = static_cast<long>(events[i].res);
      if (res < 0) {
        r.fail(static_cast<int>(-res), std::string(r.is_write ? "write" : "read") + " failed: " +
                                           std::to_string(blk.len) + " bytes at offset " +
                                           std::to_string(blk.file_off) + " of '" + r.path +
                                           "': " + std::strerror(static_cast<int>(-res)));
        stop = true;
        continue;
      }
      // A partial transfer (rare: a signal, or a read reaching the end of the file) finishes
      // synchronously on the same descriptor; transfer_sync reports EOF as a short read.
      if (res < blk.len &&
          !r.transfer_sync(blk.direct && res % kDirectAlignment == 0 ? blk.fd : r.fd_buffered,
                           blk.buf + res, blk.len - res, blk.file_off + res)) {
        stop = true;
        continue;
      }
      (blk.direct ? direct_bytes : buffered_bytes) += blk.len;
    }
  }
}

#else  // !ZERO_OPS_HAVE_LIBAIO

bool LibaioQueue::compiled() { return false; }

std::string LibaioQueue::probe() {
  return "zero-ops was built without libaio (<libaio.h> not found at build time, or ZERO_OPS_NO_LIBAIO=1)";
}

LibaioQueue::LibaioQueue(int depth) : depth_(depth) {
  throw IoError(ENOSYS, probe(), "");
}

LibaioQueue::~LibaioQueue() = default;

void LibaioQueue::run(AioRequest&, int64_t, int64_t, bool, bool, std::atomic<int64_t>&,
                      std::atomic<int64_t>&) {}

#endif  // ZERO_OPS_HAVE_LIBAIO

}  // namespace zero_ops
