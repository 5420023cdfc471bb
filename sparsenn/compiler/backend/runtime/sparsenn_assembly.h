/* Assembly of a sparse output: per-chunk level buffers (Chunk) gathered in a Result,
   the workspaces that accumulate a row's entries (DenseWS, SparseWS, and the two-phase
   CountWS and FillWS), and the copy into the caller's arrays (sn_fill). Included after
   sparsenn_kernel.h, and only by kernels that assemble a sparse output (it doubles
   their build time). Defines the entry points sn_sizes and sn_free; the generated unit
   defines sn_finish around sn_fill. Their signatures and layouts are those of
   sparsenn/compiler/backend/abi.py (tests/test_abi.py checks). Values accumulate as V
   and are rounded to the storage type S (sn_narrow) as they are written out. */
#ifndef SPARSENN_ASSEMBLY_H
#define SPARSENN_ASSEMBLY_H

#include "sparsenn_kernel.h"

#include <algorithm>
#include <climits>
#include <memory>
#include <utility>
#include <vector>

static inline void sn_fail(int& flag) {
#pragma omp atomic write
  flag = 1;
}

/* Output levels appended by one chunk of the outermost loop: per compressed level its
   coordinates and, per parent position, how many children it got. */
struct Chunk {
  std::vector<std::vector<int64_t>> cnt;
  std::vector<std::vector<I>> crd;
  std::vector<V> val;
  void init(int rank) { cnt.assign(rank, {}); crd.assign(rank, {}); val.clear(); }
};

struct Result {
  int rank, num_dense;
  std::vector<Chunk> chunks;
  /* Two-phase: pos of the one compressed level, and sn_run's arguments for phase 2. */
  std::vector<int64_t> pos;
  void* const* arrays = nullptr;
  const int64_t* dims = nullptr;
  Result(int r, int d) : rank(r), num_dense(d) {}
};

/* Append sorted, unique linear keys over output levels [level, rank) to a chunk. */
template <class Take>
static void emit_sorted(Chunk& C, int level, int rank, const int64_t* dims,
                        const std::vector<int64_t>& keys, Take take) {
  const int m = rank - level;
  if (m == 1) {  // one level left: keys are its coordinates
    std::vector<I>& crd = C.crd[level];
    for (int64_t key : keys) { crd.push_back((I)key); C.val.push_back(take(key)); }
    return;
  }
  int64_t prev[16], cur[16];
  bool first = true;
  for (int64_t key : keys) {
    int64_t rest = key;
    for (int j = m - 1; j >= 0; --j) { cur[j] = rest % dims[j]; rest /= dims[j]; }
    int d = 0;
    if (!first) while (d < m && cur[d] == prev[d]) ++d;
    for (int j = d; j < m; ++j) {
      const int l = level + j;
      C.crd[l].push_back((I)cur[j]);
      if (j > 0) C.cnt[l].back()++;
      if (l + 1 < rank) C.cnt[l + 1].push_back(0);
      prev[j] = cur[j];
    }
    C.val.push_back(take(key));
    first = false;
  }
}

/* Dense workspace: values over the whole workspace, a bitmap of touched keys and
   their list. Drained in key order: by walking the bitmap's set bits (n / 64 words +
   k keys), or by sorting the list when far fewer keys were touched than words. */
struct DenseWS {
  std::vector<V> val;
  std::vector<uint64_t> bits;
  std::vector<int64_t> list;
  void init(int64_t n) { val.assign(n, V(0)); bits.assign((n + 63) / 64, 0); }
  inline void add(int64_t x, V v) {
    uint64_t& word = bits[x >> 6];
    const uint64_t bit = uint64_t(1) << (x & 63);
    if (word & bit) { val[x] += v; } else { word |= bit; val[x] = v; list.push_back(x); }
  }
  void drain(Chunk& C, int level, int rank, const int64_t* dims) {
    const int64_t k = (int64_t)list.size();
    if (k == 0) return;
    if (k * (64 - __builtin_clzll((unsigned long long)k)) < (int64_t)bits.size()) {
      std::sort(list.begin(), list.end());
      for (int64_t x : list) bits[x >> 6] = 0;
    } else {
      list.clear();
      for (int64_t w = 0; w < (int64_t)bits.size(); ++w) {
        for (uint64_t word = bits[w]; word; word &= word - 1)
          list.push_back(w * 64 + __builtin_ctzll(word));
        bits[w] = 0;
      }
    }
    emit_sorted(C, level, rank, dims, list, [&](int64_t x) { const V v = val[x]; val[x] = V(0); return v; });
    list.clear();
  }
};

/* Two-phase workspaces over keys [0, n), n < 2^32 (a dense workspace's size). A key
   is new in the current row when its stamp is not the row's; keys are stamped without
   branches and without sharing words (a bitmap's read-modify-writes of one word would
   chain). Phase 1 only counts each row's keys. */
struct CountWS {
  std::vector<uint32_t> seen;
  uint32_t row = 1;
  int64_t n = 0;
  void init(int64_t size) { seen.assign(size, 0); }
  inline void mark(int64_t x) {
    n += seen[x] != row;
    seen[x] = row;
  }
  int64_t count() {
    const int64_t k = n;
    n = 0;
    if (++row == 0) { std::fill(seen.begin(), seen.end(), 0); row = 1; }
    return k;
  }
};

/* Index array of the result, int32 or int64 as the caller allocated it: one copy of
   sn_fill and of the fill phase serves both widths (a template per width doubled their
   build time), the width test is loop-invariant. */
struct IndexOut {
  void* base;
  int wide;
  inline void put(int64_t q, int64_t x) const {
    if (wide) ((int64_t*)base)[q] = x; else ((int32_t*)base)[q] = (int32_t)x;
  }
};

/* Phase 2 also sums values (zeroed again as they are drained; a key's sum and stamp
   share a cache line) and lists the row's keys (a repeated key is written past the
   list's end). drain writes them in order with their sums: a short list by insertion
   sort; else through a two-level bitmap (a bit per key, and per 64 words a summary
   word of the non-zero ones), set from the list and walked between the smallest and
   largest key, O(k) whatever the key range. */
struct FillWS {
  struct Slot { V val; uint32_t seen; };
  std::vector<Slot> slot;
  std::vector<uint64_t> bits, summary;
  std::unique_ptr<uint32_t[]> list;
  uint32_t row = 1;
  int64_t n = 0;
  void init(int64_t size) {
    slot.assign(size, Slot{V(0), 0});
    bits.assign((size + 63) / 64, 0);
    summary.assign((size + 4095) / 4096, 0);
    list.reset(new uint32_t[size + 1]);
  }
  inline void add(int64_t x, V v) {
    Slot& e = slot[x];
    const bool fresh = e.seen != row;
    e.seen = row;
    list[n] = (uint32_t)x;
    n += fresh;
    e.val += v;
  }
  int64_t drain(const IndexOut& crd, int64_t at, S* __restrict__ out) {
    const int64_t k = n;
    if (k == 0) return 0;
    n = 0;
    if (++row == 0) { for (Slot& e : slot) e.seen = 0; row = 1; }
    uint32_t* keys = list.get();
    if (k <= 16) {
      for (int64_t t = 1; t < k; ++t) {
        const uint32_t x = keys[t];
        int64_t u = t;
        for (; u > 0 && keys[u - 1] > x; --u) keys[u] = keys[u - 1];
        keys[u] = x;
      }
      for (int64_t t = 0; t < k; ++t) {
        const uint32_t x = keys[t];
        crd.put(at + t, x);
        out[t] = sn_narrow(slot[x].val);
        slot[x].val = V(0);
      }
      return k;
    }
    uint32_t lo = keys[0], hi = keys[0];
    uint64_t run = 0;  // bits of word w, or'ed in once per run of keys in that word
    uint32_t w = keys[0] >> 6;
    for (int64_t t = 0; t < k; ++t) {
      const uint32_t x = keys[t];
      lo = std::min(lo, x);
      hi = std::max(hi, x);
      if ((x >> 6) != w) {
        bits[w] |= run;
        summary[w >> 6] |= uint64_t(1) << (w & 63);
        run = 0;
        w = x >> 6;
      }
      run |= uint64_t(1) << (x & 63);
    }
    bits[w] |= run;
    summary[w >> 6] |= uint64_t(1) << (w & 63);
    int64_t q = 0;
    for (int64_t s = lo >> 12; s <= (int64_t)(hi >> 12); ++s) {
      for (uint64_t sw = summary[s]; sw; sw &= sw - 1) {
        const int64_t b = s * 64 + __builtin_ctzll(sw);
        for (uint64_t word = bits[b]; word; word &= word - 1) {
          const int64_t x = b * 64 + __builtin_ctzll(word);
          crd.put(at + q, x);
          out[q++] = sn_narrow(slot[x].val);
          slot[x].val = V(0);
        }
        bits[b] = 0;
      }
      summary[s] = 0;
    }
    return k;
  }
};

/* Sparse accumulator: (key, value) pairs, stably sorted and combined at drain time. */
struct SparseWS {
  std::vector<std::pair<int64_t, V>> entries;
  std::vector<int64_t> keys;
  std::vector<V> vals;
  void init(int64_t) {}
  inline void add(int64_t x, V v) { entries.emplace_back(x, v); }
  void drain(Chunk& C, int level, int rank, const int64_t* dims) {
    if (entries.empty()) return;
    std::stable_sort(entries.begin(), entries.end(),
                     [](const std::pair<int64_t, V>& a, const std::pair<int64_t, V>& b) { return a.first < b.first; });
    keys.clear(); vals.clear();
    for (const auto& kv : entries) {
      if (!keys.empty() && keys.back() == kv.first) vals.back() += kv.second;
      else { keys.push_back(kv.first); vals.push_back(kv.second); }
    }
    entries.clear();
    size_t n = 0;
    emit_sorted(C, level, rank, dims, keys, [&](int64_t) { return vals[n++]; });
  }
};

/* Per output level: stored coordinates and counts; then the number of values. */
extern "C" void sn_sizes(void* handle, int64_t* sizes) {
  const Result* r = (const Result*)handle;
  if (!r->pos.empty()) {  // two-phase: dense levels, then one compressed level
    std::fill(sizes, sizes + 2 * r->rank + 1, 0);
    sizes[2 * r->num_dense] = sizes[2 * r->rank] = r->pos.back();
    sizes[2 * r->num_dense + 1] = (int64_t)r->pos.size() - 1;
    return;
  }
  for (int l = 0; l < r->rank; ++l) {
    int64_t crd = 0, cnt = 0;
    for (const Chunk& c : r->chunks) {
      if (c.crd.empty()) continue;
      crd += (int64_t)c.crd[l].size();
      cnt += (int64_t)c.cnt[l].size();
    }
    sizes[2 * l] = crd;
    sizes[2 * l + 1] = cnt;
  }
  int64_t vals = 0;
  for (const Chunk& c : r->chunks) vals += (int64_t)c.val.size();
  sizes[2 * r->rank] = vals;
}

/* pos arrays are exclusive prefix sums of the concatenated per-parent counts. */
static int sn_fill(Result* r, void* const* out, int wide, int nthreads) {
  const int64_t nc = (int64_t)r->chunks.size();
  int slot = 0;
  std::vector<int64_t> crd_off(nc + 1), cnt_off(nc + 1), sum_off(nc + 1);
  for (int l = r->num_dense; l < r->rank; ++l) {
    const IndexOut pos{out[slot++], wide};
    const IndexOut crd{out[slot++], wide};
    crd_off[0] = cnt_off[0] = sum_off[0] = 0;
    for (int64_t c = 0; c < nc; ++c) {
      const Chunk& ch = r->chunks[c];
      const bool live = !ch.crd.empty();
      crd_off[c + 1] = crd_off[c] + (live ? (int64_t)ch.crd[l].size() : 0);
      cnt_off[c + 1] = cnt_off[c] + (live ? (int64_t)ch.cnt[l].size() : 0);
      int64_t s = 0;
      if (live) for (int64_t v : ch.cnt[l]) s += v;
      sum_off[c + 1] = sum_off[c] + s;
    }
    pos.put(0, 0);
    if (l == 0) pos.put(1, crd_off[nc]);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t c = 0; c < nc; ++c) {
      const Chunk& ch = r->chunks[c];
      if (ch.crd.empty()) continue;
      int64_t q = crd_off[c];
      for (I x : ch.crd[l]) crd.put(q++, x);
      if (l > 0) {
        int64_t run = sum_off[c], p = cnt_off[c] + 1;
        for (int64_t v : ch.cnt[l]) { run += v; pos.put(p++, run); }
      }
    }
  }
  S* val = (S*)out[slot];
  int64_t off = 0;
  std::vector<int64_t> val_off(nc + 1, 0);
  for (int64_t c = 0; c < nc; ++c) { val_off[c] = off; off += (int64_t)r->chunks[c].val.size(); }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t c = 0; c < nc; ++c)
    std::transform(r->chunks[c].val.begin(), r->chunks[c].val.end(), val + val_off[c],
                   [](V v) { return sn_narrow(v); });
  return 0;
}

extern "C" void sn_free(void* handle) { delete (Result*)handle; }

#endif
