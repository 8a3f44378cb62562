// The next weight panel prefetched into L2 while a chunk of rows passes over the current one, shared by
// the chunk's row blocks: each takes the share of the panel's rows in proportion to its rows of x, and
// spreads it evenly over its steps, so the stream from memory runs through the whole panel's time.
// (A prefetch moves bytes, never a value: the arithmetic is the same with or without it.)
#pragma once
#include <cstdint>

#include "vec16.h"

class PanelPrefetch {
 public:
  // `next`: the next panel (nullptr: none), `rows` of `row_bytes` each, read in `steps` steps; this block
  // has x's rows [first, first + count) of the chunk's `total`.
  PanelPrefetch(const char* next, int64_t row_bytes, int64_t steps, int64_t first, int64_t count, int64_t total)
      : row_bytes_(row_bytes), steps_(steps) {
    if (next == nullptr) return;
    const int64_t lo = steps * first / total, hi = steps * (first + count) / total;
    at_ = next + lo * row_bytes;
    share_ = hi - lo;
  }

  // One step of the block: the rows due by now (at most one a step: a share is at most `steps` rows).
  inline void step() {
    if (share_ == 0) return;
    acc_ += share_;
    if (acc_ >= steps_) {
      acc_ -= steps_;
      prefetch_l2(at_, row_bytes_);
      at_ += row_bytes_;
    }
  }

 private:
  const char* at_ = nullptr;
  int64_t row_bytes_, steps_, share_ = 0, acc_ = 0;
};
