// Agglomerative attention kernels; the maths and the scan scheme are in the
// header. Every pass is a loop over rows doing O(M) vector work per row, so the
// kernels are bound by memory traffic: each pass reads its inputs once, except
// that a causal chunk which does not start its sequence is read twice (once for
// the carry, once for the output).
#include "kernels/agglomerative_attention.h"

#include <algorithm>
#include <functional>

#include "kernels/common/parallel.h"
#include "kernels/common/strided.h"
#include "kernels/common/vec.h"
#include "kernels/common/visibility.h"

ATTNKIT_KERNELS_BEGIN
namespace {

// Rows per scan block. Block totals cost (M + 1) floats per block, 1/64 of the
// values; the block is also the unit of work a chunk is made of.
constexpr int64_t kBlock = 64;

// ---------------------------------------------------------------------------
// Work split. A sequence of `rows` rows (keys or queries) is cut into blocks of
// kBlock rows and the blocks into `chunks` contiguous chunks. A task is one
// (batch element, chunk); it walks its rows in order and, within a row, every
// class. Classes go innermost because the natural layout of v and out is
// (N, S, H, M), a view of x P: the task then reads and writes memory in
// order, where a class-by-class sweep would take 1/H of each row H times.
// The chunk count gives every thread work when the batch is small; it decides
// who computes what, never the arithmetic.
// ---------------------------------------------------------------------------
struct Split {
  Split(int64_t rows, int64_t batch) : rows(rows), blocks((rows + kBlock - 1) / kBlock) {
    const int64_t elements = std::max<int64_t>(batch, 1);
    const int64_t per_element = (num_threads() + elements - 1) / elements;
    chunks = std::clamp<int64_t>(per_element, 1, std::max<int64_t>(blocks, 1));
  }
  int64_t first_block(int64_t chunk) const { return chunk * blocks / chunks; }
  int64_t row_begin(int64_t block) const { return block * kBlock; }
  int64_t row_end(int64_t block) const { return std::min(rows, (block + 1) * kBlock); }

  int64_t rows, blocks, chunks;
};

/// Runs body(n, chunk, scratch) for every batch element n < N and chunk <
/// chunks, each task with `scratch_floats` floats of its thread's own.
template <class Body>
void parallel_tasks(int64_t N, int64_t chunks, int64_t scratch_floats, const Body& body) {
  parallel_for(N * chunks, scratch_floats,
               [&](int64_t task, float* scratch) { body(task / chunks, task % chunks, scratch); });
}

/// Per (batch element, class, block) records of M + 1 floats: sums, then
/// count (the forward), or their gradients (the backward).
class BlockTotals {
 public:
  BlockTotals(int64_t N, int64_t H, int64_t blocks, int64_t M)
      : H_(H), blocks_(blocks), width_(M + 1), data_(static_cast<std::size_t>(N * H * blocks * (M + 1))) {}
  float* at(int64_t n, int64_t h, int64_t b) { return data_.data() + ((n * H_ + h) * blocks_ + b) * width_; }

  /// Zeroes the records of block b of every class of n.
  void clear(int64_t n, int64_t b) {
    for (int64_t h = 0; h < H_; ++h) std::fill(at(n, h, b), at(n, h, b) + width_, 0.f);
  }

  /// carries (H records) = for each class, the totals of blocks [b0, b1) of n
  /// added one by one in the scan's direction, exactly as a thread scanning
  /// those blocks adds them.
  void carries(int64_t n, int64_t b0, int64_t b1, bool backwards, float* carries) {
    std::fill(carries, carries + H_ * width_, 0.f);
    for (int64_t h = 0; h < H_; ++h)
      for (int64_t k = 0; k < b1 - b0; ++k)
        vec::add(carries + h * width_, at(n, h, backwards ? b1 - 1 - k : b0 + k), width_);
  }

 private:
  int64_t H_, blocks_, width_;
  Buffer<float> data_;
};

// ---------------------------------------------------------------------------
// Pointers into one (batch element n, class h).
// ---------------------------------------------------------------------------
struct Forward {
  Forward(const AgglomerativeParams& p, int64_t n, int64_t h) : p(p) {
    cq = p.cq + n * p.cq_stride[0] + h * p.cq_stride[1];
    cr = p.cr + n * p.cr_stride[0] + h * p.cr_stride[1];
    v = p.v + n * p.v_stride[0] + h * p.v_stride[1];
    out = p.out + n * p.out_stride[0] + h * p.out_stride[1];
    const int64_t rows = agglomerative_saved_rows(p.causal, p.L), s = n * p.H + h;
    avg = p.avg ? p.avg + s * rows * p.M : nullptr;  // may be null when M = 0
    den = p.den ? p.den + s * rows : nullptr;
  }
  float q(int64_t i) const { return cq[i * p.cq_stride[2]]; }
  float r(int64_t t) const { return cr[t * p.cr_stride[2]]; }
  const float* v_row(int64_t t) const { return v + t * p.v_stride[2]; }
  float* out_row(int64_t i) const { return out + i * p.out_stride[2]; }

  const AgglomerativeParams& p;
  const float* cq;
  const float* cr;
  const float* v;
  float* out;
  float* avg;  // nullptr when the forward does not save (or M = 0)
  float* den;  // nullptr exactly when the forward does not save
};

struct Backward : Forward {
  Backward(const AgglomerativeBackwardParams& p, int64_t n, int64_t h) : Forward(p, n, h), b(p) {
    dout = p.dout + n * p.dout_stride[0] + h * p.dout_stride[1];
    dcq = p.dcq + n * p.dcq_stride[0] + h * p.dcq_stride[1];
    dcr = p.dcr + n * p.dcr_stride[0] + h * p.dcr_stride[1];
    dv = p.dv + n * p.dv_stride[0] + h * p.dv_stride[1];
  }
  const float* g_row(int64_t i) const { return dout + i * b.dout_stride[2]; }
  float& dq(int64_t i) const { return dcq[i * b.dcq_stride[2]]; }
  float& dr(int64_t t) const { return dcr[t * b.dcr_stride[2]]; }
  float* dv_row(int64_t t) const { return dv + t * b.dv_stride[2]; }

  const AgglomerativeBackwardParams& b;
  const float* dout;
  float* dcq;
  float* dcr;
  float* dv;
};

// ---------------------------------------------------------------------------
// Forward.
// ---------------------------------------------------------------------------

/// Adds key row t to the running sums (M) and count (sums[M]). Every sum of
/// key rows, whoever computes it, goes through here.
inline void add_key_row(const Forward& x, int64_t t, float* sums) {
  axpy_strided(sums, x.r(t), x.v_row(t), x.p.v_stride[3], x.p.M);
  sums[x.p.M] += x.r(t);
}

/// The totals of the key blocks of chunk c, every class, batch element n.
void key_chunk_totals(const AgglomerativeParams& p, const Split& keys, int64_t n, int64_t c,
                      BlockTotals& totals) {
  for (int64_t b = keys.first_block(c); b < keys.first_block(c + 1); ++b) {
    totals.clear(n, b);
    for (int64_t t = keys.row_begin(b); t < keys.row_end(b); ++t)
      for (int64_t h = 0; h < p.H; ++h) add_key_row(Forward(p, n, h), t, totals.at(n, h, b));
  }
}

inline float inverse_denominator(float count, float clip) { return 1.f / std::max(count, clip); }

/// out_i = cq_i a with a = inv sums, inv = 1 / max(count, clip).
inline void write_out_row(const Forward& x, int64_t i, float inv, const float* sums) {
  float* out = x.out_row(i);
  const float q = x.q(i);
  for (int64_t m = 0; m < x.p.M; ++m) out[m * x.p.out_stride[3]] = q * (inv * sums[m]);
}

/// Saves a = inv sums and the unclipped count in saved row `row`, if saving.
inline void save_average(const Forward& x, int64_t row, float inv, const float* sums, float count) {
  if (!x.den) return;
  if (x.p.M > 0) put_row(sums, x.p.M, x.avg + row * x.p.M, 1, inv);
  x.den[row] = count;
}

void forward_full(const AgglomerativeParams& p) {
  const int64_t W = p.M + 1;
  const Split keys(p.S, p.N);
  BlockTotals totals(p.N, p.H, keys.blocks, p.M);
  parallel_tasks(p.N, keys.chunks, 0,
                 [&](int64_t n, int64_t c, float*) { key_chunk_totals(p, keys, n, c, totals); });
  // Every query of (n, h) reads the same average; each task adds up the block
  // totals of its batch element itself (a few hundred floats per block).
  const Split queries(p.L, p.N);
  parallel_tasks(p.N, queries.chunks, p.H * W, [&](int64_t n, int64_t c, float* sums) {
    totals.carries(n, 0, keys.blocks, /*backwards=*/false, sums);
    if (c == 0)
      for (int64_t h = 0; h < p.H; ++h) {
        const float* s = sums + h * W;
        save_average(Forward(p, n, h), 0, inverse_denominator(s[p.M], p.clip), s, s[p.M]);
      }
    for (int64_t b = queries.first_block(c); b < queries.first_block(c + 1); ++b)
      for (int64_t i = queries.row_begin(b); i < queries.row_end(b); ++i)
        for (int64_t h = 0; h < p.H; ++h) {
          const float* s = sums + h * W;
          write_out_row(Forward(p, n, h), i, inverse_denominator(s[p.M], p.clip), s);
        }
  });
}

void forward_causal(const AgglomerativeParams& p) {
  const int64_t H = p.H, M = p.M, W = M + 1;
  const int64_t shift = causal_offset(p.L, p.S);  // query i reads the keys t <= i + shift
  const Split keys(p.S, p.N);
  // Pass 1: the totals of the blocks whose sums a later chunk needs as carry.
  BlockTotals totals(p.N, H, keys.blocks, M);
  parallel_tasks(p.N, keys.chunks - 1, 0,
                 [&](int64_t n, int64_t c, float*) { key_chunk_totals(p, keys, n, c, totals); });
  // Pass 2: each chunk scans its blocks from its carries and writes its queries.
  parallel_tasks(p.N, keys.chunks, (2 * H + 1) * W, [&](int64_t n, int64_t c, float* scratch) {
    float* carries = scratch;           // per class: sums of the blocks before
    float* locals = scratch + H * W;    // per class: sums of this block so far
    float* sums = scratch + 2 * H * W;  // carry + local
    const int64_t b0 = keys.first_block(c), b1 = keys.first_block(c + 1);
    totals.carries(n, 0, b0, /*backwards=*/false, carries);
    if (c == 0)  // queries before the first key see nothing
      for (int64_t i = 0; i < std::min(p.L, -shift); ++i)
        for (int64_t h = 0; h < H; ++h) {
          const Forward x(p, n, h);
          zero_row(M, x.out_row(i), p.out_stride[3]);
          if (x.den) {
            if (M > 0) std::fill(x.avg + i * M, x.avg + i * M + M, 0.f);
            x.den[i] = 0.f;
          }
        }
    for (int64_t b = b0; b < b1; ++b) {
      std::fill(locals, locals + H * W, 0.f);
      for (int64_t t = keys.row_begin(b); t < keys.row_end(b); ++t)
        for (int64_t h = 0; h < H; ++h) {
          const Forward x(p, n, h);
          add_key_row(x, t, locals + h * W);
          if (t < shift) continue;  // no query reads this prefix
          std::transform(carries + h * W, carries + h * W + W, locals + h * W, sums,
                         std::plus<float>());
          const float inv = inverse_denominator(sums[M], p.clip);
          write_out_row(x, t - shift, inv, sums);
          save_average(x, t - shift, inv, sums, sums[M]);
        }
      vec::add(carries, locals, H * W);
    }
  });
}

// ---------------------------------------------------------------------------
// Backward. For the average a = sums / D, D = max(count, clip), read by query i
// with class weight cq_i and output gradient g_i:
//   dcq_i = g_i . a,   dsums = (cq_i / D) g_i,
//   dcount = -(cq_i / D) (g_i . a)  (0 where the clip is active),
// and key row t gets dv_t = cr_t dsums, dcr_t = v_t . dsums + dcount, summed
// over the averages that contain it: all queries when full, the queries
// reading prefixes j >= t when causal (a scan from the last key down).
// ---------------------------------------------------------------------------
struct QueryGrad {
  float dcq;     // g . a
  float weight;  // cq / D: dsums = weight * g
  float dcount;
};

inline QueryGrad query_grad(float cq, const float* g, int64_t gs, const float* avg, float count,
                            float clip, int64_t M) {
  QueryGrad r;
  r.dcq = dot_strided(g, gs, avg, M);
  r.weight = cq / std::max(count, clip);
  r.dcount = count < clip ? 0.f : -r.weight * r.dcq;
  return r;
}

/// Key row t receives the gradient of its sums (dsums, M) and count (dsums[M]).
inline void write_key_row(const Backward& x, int64_t t, const float* dsums) {
  const int64_t M = x.p.M;
  put_row(dsums, M, x.dv_row(t), x.b.dv_stride[3], x.r(t));
  x.dr(t) = dot_strided(x.v_row(t), x.p.v_stride[3], dsums, M) + dsums[M];
}

void backward_full(const AgglomerativeBackwardParams& p) {
  const int64_t M = p.M, W = M + 1;
  // Pass 1: dcq, and the block totals of da = sum_i cq_i g_i.
  const Split queries(p.L, p.N);
  BlockTotals totals(p.N, p.H, queries.blocks, M);
  parallel_tasks(p.N, queries.chunks, 0, [&](int64_t n, int64_t c, float*) {
    for (int64_t b = queries.first_block(c); b < queries.first_block(c + 1); ++b) {
      totals.clear(n, b);
      for (int64_t i = queries.row_begin(b); i < queries.row_end(b); ++i)
        for (int64_t h = 0; h < p.H; ++h) {
          const Backward x(p, n, h);
          x.dq(i) = dot_strided(x.g_row(i), p.dout_stride[3], x.avg, M);
          axpy_strided(totals.at(n, h, b), x.q(i), x.g_row(i), p.dout_stride[3], M);
        }
    }
  });
  // Pass 2: per (n, h), all queries together act as one query of class weight
  // 1 and output gradient da, and every key row gets the same gradient.
  const Split keys(p.S, p.N);
  parallel_tasks(p.N, keys.chunks, p.H * W, [&](int64_t n, int64_t c, float* grads) {
    totals.carries(n, 0, queries.blocks, /*backwards=*/false, grads);
    for (int64_t h = 0; h < p.H; ++h) {
      const Backward x(p, n, h);
      float* g = grads + h * W;
      const QueryGrad r = query_grad(1.f, g, 1, x.avg, x.den[0], p.clip, M);
      for (int64_t m = 0; m < M; ++m) g[m] *= r.weight;
      g[M] = r.dcount;
    }
    for (int64_t b = keys.first_block(c); b < keys.first_block(c + 1); ++b)
      for (int64_t t = keys.row_begin(b); t < keys.row_end(b); ++t)
        for (int64_t h = 0; h < p.H; ++h) write_key_row(Backward(p, n, h), t, grads + h * W);
  });
}

/// Adds the gradient of the average read at key row t (by query t - shift, if
/// any) to the running dsums (M) and dcount (local[M]); writes its dcq when
/// asked. Every causal gradient sum, whoever computes it, goes through here.
inline void add_query_grad(const Backward& x, int64_t t, int64_t shift, float* local, bool write_dcq) {
  const int64_t i = t - shift;
  if (i < 0) return;
  const int64_t M = x.p.M;
  const QueryGrad r = query_grad(x.q(i), x.g_row(i), x.b.dout_stride[3], x.avg + i * M, x.den[i],
                                 x.p.clip, M);
  if (write_dcq) x.dq(i) = r.dcq;
  axpy_strided(local, r.weight, x.g_row(i), x.b.dout_stride[3], M);
  local[M] += r.dcount;
}

void backward_causal(const AgglomerativeBackwardParams& p) {
  const int64_t H = p.H, M = p.M, W = M + 1;
  const int64_t shift = causal_offset(p.L, p.S);
  const Split keys(p.S, p.N);
  // The scan runs from the last key down, so chunk c's carry is the blocks
  // after it. Pass 1: the totals of the blocks of chunks 1 .. chunks-1.
  BlockTotals totals(p.N, H, keys.blocks, M);
  parallel_tasks(p.N, keys.chunks - 1, 0, [&](int64_t n, int64_t c, float*) {
    for (int64_t b = keys.first_block(c + 1); b < keys.first_block(c + 2); ++b) {
      totals.clear(n, b);
      for (int64_t t = keys.row_end(b) - 1; t >= keys.row_begin(b); --t)
        for (int64_t h = 0; h < H; ++h)
          add_query_grad(Backward(p, n, h), t, shift, totals.at(n, h, b), /*write_dcq=*/false);
    }
  });
  // Pass 2: each chunk scans its blocks backwards from its carries.
  parallel_tasks(p.N, keys.chunks, (2 * H + 1) * W, [&](int64_t n, int64_t c, float* scratch) {
    float* carries = scratch;            // per class: gradient sums of the blocks after
    float* locals = scratch + H * W;     // per class: of this block so far
    float* dsums = scratch + 2 * H * W;  // carry + local
    const int64_t b0 = keys.first_block(c), b1 = keys.first_block(c + 1);
    totals.carries(n, b1, keys.blocks, /*backwards=*/true, carries);
    if (c == 0)  // queries before the first key output zeros: nothing flows back
      for (int64_t i = 0; i < std::min(p.L, -shift); ++i)
        for (int64_t h = 0; h < H; ++h) Backward(p, n, h).dq(i) = 0.f;
    for (int64_t b = b1 - 1; b >= b0; --b) {
      std::fill(locals, locals + H * W, 0.f);
      for (int64_t t = keys.row_end(b) - 1; t >= keys.row_begin(b); --t)
        for (int64_t h = 0; h < H; ++h) {
          const Backward x(p, n, h);
          add_query_grad(x, t, shift, locals + h * W, /*write_dcq=*/true);
          std::transform(carries + h * W, carries + h * W + W, locals + h * W, dsums,
                         std::plus<float>());
          write_key_row(x, t, dsums);
        }
      vec::add(carries, locals, H * W);
    }
  });
}

}  // namespace

void agglomerative_forward(const AgglomerativeParams& p) {
  if (p.causal)
    forward_causal(p);
  else
    forward_full(p);
}

void agglomerative_backward(const AgglomerativeBackwardParams& p) {
  if (p.causal)
    backward_causal(p);
  else
    backward_full(p);
}

ATTNKIT_KERNELS_END
