#ifndef COLOD_COMMON_INT_MATH_H_
#define COLOD_COMMON_INT_MATH_H_

namespace colod {

// The integer r >= 1 with r^k == n, or 0 if n is not a perfect k-th power
// (used for the q of 2D/2.5D/3D meshes: tp = q^2, tp/d = q^2, tp = q^3).
inline int IntegerRoot(int n, int k) {
  if (n < 1 || k < 1) return 0;
  for (int r = 1;; ++r) {
    long long p = 1;
    for (int i = 0; i < k; ++i) p *= r;
    if (p == n) return r;
    if (p > n) return 0;
  }
}

}  // namespace colod

#endif  // COLOD_COMMON_INT_MATH_H_
