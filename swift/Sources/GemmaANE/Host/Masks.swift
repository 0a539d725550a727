/// The additive masks of CONTRACT §3, as `gemma_ane/bundle/host.py` builds them: 0 lets a slot through,
/// `maskBlocked` blocks it (not -inf, which the Neural Engine mishandles; see host.MASK_BLOCKED).
public enum Masks {
    public static let maskBlocked: Float = -40000

    /// Linear cache, slot = position: row t (position p0+t) sees slots i <= p0+t. (T, context) row-major.
    public static func full(p0: Int, count: Int, context: Int) -> [Float] {
        var out = [Float](repeating: maskBlocked, count: count * context)
        for t in 0..<count {
            for i in 0..<min(p0 + t + 1, context) { out[t * context + i] = 0 }
        }
        return out
    }

    /// The newest position each ring slot holds once positions up to `last` are written, or -1 (never written).
    static func held(last: Int, ring: Int) -> [Int] {
        (0..<ring).map { slot in
            guard last >= 0 else { return -1 }
            let h = last - (((last - slot) % ring) + ring) % ring
            return h >= 0 ? h : -1
        }
    }

    /// A ring of `ring` slots written (p mod ring) before attending: row t (position p) sees a slot iff it holds
    /// a position q with p - window < q <= p, after the batch's writes. (T, ring) row-major.
    public static func sliding(p0: Int, count: Int, window: Int, ring: Int) -> [Float] {
        let held = held(last: p0 + count - 1, ring: ring)
        var out = [Float](repeating: maskBlocked, count: count * ring)
        for t in 0..<count {
            let p = p0 + t
            for (s, q) in held.enumerated() where q >= 0 && q <= p && q > p - window { out[t * ring + s] = 0 }
        }
        return out
    }

    /// KV-only prefill: row t attends over [the ring before the batch | the batch]; a ring column is valid iff its
    /// slot holds a position in (p0+t-window, p0-1], a batch column j iff j <= t. (T, ring + T) row-major.
    public static func kvSliding(p0: Int, count: Int, window: Int, ring: Int) -> [Float] {
        let held = held(last: p0 - 1, ring: ring)
        let width = ring + count
        var out = [Float](repeating: maskBlocked, count: count * width)
        for t in 0..<count {
            for (s, q) in held.enumerated() where q >= 0 && q > p0 + t - window { out[t * width + s] = 0 }
            for j in 0...t { out[t * width + ring + j] = 0 }
        }
        return out
    }
}
