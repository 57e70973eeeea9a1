// The corpus lookup's walk (eagle_serve.spec.lookup.CorpusIndex; its `walk` is the reference this
// computes exactly, ~26 us a lookup there in Python, ~5 here): the longest suffix of a
// request's tokens that occurs in the corpus, by two binary searches a token on the suffix array
// of the corpus read backwards, then the tokens most of its occurrences go on with.
#include "cpu.h"

#include <algorithm>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kSeparator = -1;  // between records (lookup.SEPARATOR)

template <typename T>
CorpusWalk walk(const T* rev, const int32_t* sa, int64_t N, const std::vector<int64_t>& ctx,
                int64_t limit, double min_prob, int64_t vote_cap) {
  // the occurrences of ctx's last n tokens are sa[lo, hi): suffixes that start with them reversed
  int64_t lo = 0, hi = N, n = 0;
  const int64_t len = static_cast<int64_t>(ctx.size());
  for (; n < len; ++n) {
    const int64_t token = ctx[len - 1 - n];
    const int32_t* a = std::lower_bound(sa + lo, sa + hi, token,
                                        [&](int32_t s, int64_t t) { return rev[s + n] < t; });
    const int32_t* b = std::upper_bound(a, sa + hi, token,
                                        [&](int64_t t, int32_t s) { return t < rev[s + n]; });
    if (a == b) break;
    lo = a - sa, hi = b - sa;
  }
  std::vector<int64_t> out, agreeing, totals;
  if (n == 0) return {0, out, agreeing, totals};
  // the token after the occurrence that suffix s starts is rev[s - 1], the next rev[s - 2], ...
  const int64_t step = (hi - lo + vote_cap - 1) / vote_cap;  // at most vote_cap, evenly spaced
  std::vector<int64_t> places, nexts, sorted;
  for (int64_t i = lo; i < hi; i += step) places.push_back(sa[i] - 1);
  double prob = 1.0;
  while (static_cast<int64_t>(out.size()) < limit) {
    nexts.clear(), sorted.clear();
    for (int64_t r : places) {
      nexts.push_back(rev[r]);
      if (rev[r] != kSeparator) sorted.push_back(rev[r]);
    }
    if (sorted.empty()) break;
    std::sort(sorted.begin(), sorted.end());
    int64_t token = 0, best = 0;  // the most frequent, the lowest on ties
    for (size_t i = 0, j; i < sorted.size(); i = j) {
      for (j = i; j < sorted.size() && sorted[j] == sorted[i]; ++j) {}
      if (static_cast<int64_t>(j - i) > best) best = j - i, token = sorted[i];
    }
    const int64_t total = static_cast<int64_t>(sorted.size());
    prob *= static_cast<double>(best) / static_cast<double>(total);
    if (prob < min_prob) break;
    out.push_back(token), agreeing.push_back(best), totals.push_back(total);
    size_t kept = 0;
    for (size_t i = 0; i < places.size(); ++i)
      if (nexts[i] == token) places[kept++] = places[i] - 1;
    places.resize(kept);
  }
  return {n, out, agreeing, totals};
}

}  // namespace

CorpusWalk corpus_walk(const at::Tensor& reverse, const at::Tensor& suffixes,
                       const std::vector<int64_t>& ctx, int64_t limit, double min_prob,
                       int64_t vote_cap) {
  TORCH_CHECK(reverse.dim() == 1 && suffixes.dim() == 1 && reverse.numel() == suffixes.numel() &&
              reverse.is_contiguous() && suffixes.is_contiguous() &&
              suffixes.scalar_type() == at::kInt && vote_cap > 0,
              "corpus_walk: reverse [N] int16/int32, suffixes [N] int32, contiguous");
  const int32_t* sa = suffixes.data_ptr<int32_t>();
  const int64_t N = suffixes.numel();
  if (reverse.scalar_type() == at::kShort)
    return walk(reverse.data_ptr<int16_t>(), sa, N, ctx, limit, min_prob, vote_cap);
  TORCH_CHECK(reverse.scalar_type() == at::kInt, "corpus_walk: reverse int16 or int32");
  return walk(reverse.data_ptr<int32_t>(), sa, N, ctx, limit, min_prob, vote_cap);
}
