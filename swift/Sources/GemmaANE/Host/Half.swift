/// IEEE half precision by hand: Swift's Float16 is unavailable on Intel Macs, and the bundle's fp16 bytes
/// must round exactly as numpy's `astype(float16)` rounds (to nearest, ties to even).
@inline(__always)
func halfBits(_ value: Float) -> UInt16 {
    let x = value.bitPattern
    let sign = UInt16((x >> 16) & 0x8000)
    let exponent = Int((x >> 23) & 0xff)
    var mantissa = x & 0x7f_ffff
    if exponent == 0xff { return sign | 0x7c00 | (mantissa != 0 ? 0x200 : 0) }  // inf, NaN
    let e = exponent - 127 + 15
    if e >= 0x1f { return sign | 0x7c00 }  // past fp16's largest: inf
    if e <= 0 {  // a subnormal half (or zero): the implicit bit joins the mantissa
        if e < -10 { return sign }
        mantissa |= 0x80_0000
        let shift = UInt32(14 - e)
        var h = mantissa >> shift
        let rest = mantissa & ((1 << shift) - 1), half = UInt32(1) << (shift - 1)
        if rest > half || (rest == half && h & 1 != 0) { h += 1 }
        return sign | UInt16(h)
    }
    var h = UInt32(e << 10) | (mantissa >> 13)
    let rest = mantissa & 0x1fff
    if rest > 0x1000 || (rest == 0x1000 && h & 1 != 0) { h += 1 }  // a carry into the exponent is right
    return sign | UInt16(h)
}

@inline(__always)
func floatFromHalf(_ bits: UInt16) -> Float {
    let sign = UInt32(bits & 0x8000) << 16
    let e = UInt32((bits >> 10) & 0x1f), m = UInt32(bits & 0x3ff)
    if e == 0 { return Float(bitPattern: sign) + (sign != 0 ? -1 : 1) * Float(m) * 0x1p-24 }
    if e == 0x1f { return Float(bitPattern: sign | 0x7f80_0000 | (m << 13)) }
    return Float(bitPattern: sign | ((e + 112) << 23) | (m << 13))
}
