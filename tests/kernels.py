"""C kernels shared by the tests."""

SCALE = r"""
#include <stdint.h>
void kernel(float *out, const float *x, int64_t n, double s) {
  for (int64_t i = 0; i < n; i++) out[i] = x[i] * (float)s;
}
"""

ADD_ONE = r"""
#include <stdint.h>
void kernel(uint8_t *buf, int64_t n) { for (int64_t i = 0; i < n; i++) buf[i] += 1; }
"""

GATE = r"""
#include <stdint.h>
/* Spin until the int32 at address `flag` becomes non-zero (bounded), then write what it saw to out[0]. */
void kernel(int32_t *out, int64_t flag, int64_t max_spins) {
  volatile int32_t *f = (volatile int32_t *)(intptr_t)flag;
  int64_t i = 0;
  while (*f == 0 && i < max_spins) i++;
  out[0] = *f;
}
"""

AFFINE = r"""
#include <stdint.h>
void kernel(uint8_t *b, int64_t n, int64_t a, int64_t c) {
  for (int64_t i = 0; i < n; i++) b[i] = (uint8_t)(b[i] * a + c);
}
"""

ACCUMULATE = r"""
#include <stdint.h>
void kernel(uint8_t *o, const uint8_t *x, int64_t n) { for (int64_t i = 0; i < n; i++) o[i] = (uint8_t)(o[i] + x[i]); }
"""
