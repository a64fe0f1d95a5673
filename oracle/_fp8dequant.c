/* FP8 block-scaled dequantization for the oracle's checkpoint reader: the fast path of oracle/fp8.py, whose numpy
 * code (`dequantize_numpy`) is the specification this file must match bit for bit and the fallback when it is not
 * built.
 *
 *   out[r, c] = e4m3(src[r, c]) * scale[r / br, c / bc]        float32, one rounding per element
 *
 * src is float8_e4m3fn bit patterns [rows, cols] (one byte each), scale float32 [ceil(rows/br), ceil(cols/bc)]
 * (F32 `weight_scale_inv`, or UE8M0 exponents the caller has already decoded to float32: the product is the same
 * float32 multiply either way), out float32 [rows, cols]. Rows of src and out may be strided (a slice of a wider
 * buffer, e.g. the gate rows of a fused [2I, D] expert buffer); the last row/column block may be partial.
 *
 * The decode is a 256-entry float table, built here from the bit layout (1 sign, 4 exponent bits with bias 7,
 * 3 mantissa bits; no infinities; S.1111.111 is NaN), so it is independent of the numpy table it is tested against.
 * Every e4m3 value is exact in float32: subnormals m * 2^-9 included, -0 keeps its sign, and both NaN encodings
 * decode to the quiet NaN 0x7fc00000 that the numpy table holds. Then each row is walked in column blocks, the
 * block's scale loaded once per segment, so the inner loop is `out = table[byte] * k` over contiguous memory:
 * gcc -O3 vectorises it (about 5x faster than numpy's take-then-multiply on a 2048 x 7168 expert, where it is
 * bound by writing the float32 output).
 *
 * Built by setuptools as the optional extension oracle._fp8dequant (setup.py) and loaded with ctypes; it holds no
 * Python objects, so the call releases the GIL.
 */
#include <stdint.h>
#include <string.h>

/* What oracle/fp8.py checks before trusting this library: a stale build (the source changed, `pip install -e .`
 * not rerun) is not used. Bump both when the kernel's meaning or signature changes. */
#define FP8DEQUANT_VERSION 1

int mtp_fp8dequant_version(void) { return FP8DEQUANT_VERSION; }

static float e4m3_value(uint32_t bits) {
    uint32_t exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
    float value;
    if (exponent == 15 && mantissa == 7) {
        uint32_t quiet_nan = 0x7fc00000u;  /* sign dropped, as in the numpy table */
        memcpy(&value, &quiet_nan, sizeof value);
        return value;
    }
    if (exponent == 0) {
        value = (float)mantissa * 0x1p-9f;  /* subnormal: m/8 * 2^-6, exact */
    } else {
        uint32_t f32 = ((exponent + 120u) << 23) | (mantissa << 20);  /* rebias 7 -> 127, widen the mantissa */
        memcpy(&value, &f32, sizeof value);
    }
    return (bits & 0x80) ? -value : value;  /* negation flips the sign bit only: -0 stays -0 */
}

/* One row segment in one column block: a loop over contiguous memory with a loop-invariant scale. */
static void dequant_segment(const uint8_t *restrict src, float *restrict out, int64_t n, float scale,
                            const float *restrict table) {
    for (int64_t c = 0; c < n; c++)
        out[c] = table[src[c]] * scale;
}

/* src row r starts at src + r * src_stride (bytes), out row r at out + r * out_stride (floats); scale is
 * C-contiguous [ceil(rows/br), ceil(cols/bc)]. The caller (oracle/fp8.py) checks the shapes. */
void mtp_fp8_dequant(const uint8_t *src, int64_t src_stride, const float *scale, int64_t rows, int64_t cols,
                     int64_t br, int64_t bc, float *out, int64_t out_stride) {
    float table[256];
    for (uint32_t b = 0; b < 256; b++)
        table[b] = e4m3_value(b);
    int64_t scale_cols = (cols + bc - 1) / bc;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src_row = src + r * src_stride;
        float *out_row = out + r * out_stride;
        const float *scale_row = scale + (r / br) * scale_cols;
        for (int64_t block = 0, c0 = 0; c0 < cols; block++, c0 += bc) {
            int64_t n = cols - c0 < bc ? cols - c0 : bc;  /* the last block may be partial */
            dequant_segment(src_row + c0, out_row + c0, n, scale_row[block], table);
        }
    }
}
