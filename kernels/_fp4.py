"""The fp4 (e2m1) experts' formats shared by the kernels that decode them: the e8m0 scale group and the
fold of a k block's four scales into e4m3 codes (moe_experts' Triton kernels, moe_grouped_fp4_sm90)."""

FP4_GROUP = 32               # inputs per e8m0 scale of an fp4 weight

# fp4_fold: a weight row's e8m0 scales s within one k block may span at most 2^FOLD_SPREAD: its e2m1
# values are then held in e4m3 as value x 2^(s - top + 6) (top: the row's largest s in the block),
# in [2^-6, 384]: all normal e4m3, exact; the product is multiplied by 2^(top - 133) per row.
FOLD_SPREAD = 11


def _fold_ptx_half(magnitudes: str, signs: str, out: str) -> str:
    """One nibble half of FOLD_PTX: magnitudes / signs, the instructions leaving its 3-bit magnitudes in
    x and its sign bits (0x80 of each byte) in d; out, the operand it writes."""
    return (magnitudes + "shr.b32 y, x, 4;\nor.b32 y, y, x;\nprmt.b32 s, y, y, 0x0020;\nprmt.b32 m, lut0, lut1, s;\n"
            "prmt.b32 n, nz0, nz1, s;\nand.b32 n, n, $3;\nadd.u32 m, m, n;\n" + signs + f"or.b32 {out}, m, d;\n")


# PTX of the fold for 4 packed bytes ($2) and their exponent offsets ($3, 8 (s - top + FOLD_SPREAD) of
# each byte's scale group): each nibble's magnitude (3 bits) indexes two byte tables (prmt): the e4m3 code
# of its value x 2^-5 (0x08 .. 0x24) and a nonzero mask; the offset (a multiple of 8, <= 88: no byte
# carries) is added to nonzero codes' exponent fields and the sign bit put on. $0: the low nibbles' codes,
# $1: the high nibbles'.
FOLD_PTX = (
    "\n{\n.reg .b32 x, y, s, m, n, d, lut0, lut1, nz0, nz1;\nmov.b32 lut0, 0x14100800;\nmov.b32 lut1, 0x24201C18;\n"
    "mov.b32 nz0, 0xFFFFFF00;\nmov.b32 nz1, 0xFFFFFFFF;\n"
    + _fold_ptx_half("and.b32 x, $2, 0x07070707;\n", "shl.b32 d, $2, 4;\nand.b32 d, d, 0x80808080;\n", "$0")
    + _fold_ptx_half("shr.b32 x, $2, 4;\nand.b32 x, x, 0x07070707;\n", "and.b32 d, $2, 0x80808080;\n", "$1")
    + "}\n")
