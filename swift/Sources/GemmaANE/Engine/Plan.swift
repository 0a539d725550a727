/// The prompt paths of CONTRACT §3 and the plan over them, as `runtime/engine.py` makes it: which function runs
/// which tokens of a prompt, given the position, the context and the functions the chunks carry.
public struct PromptPaths: Sendable, Equatable {
    public var context: Int
    public var window: Int
    public var ring: Int
    /// prefill_b{B}, or nil when the bundle has none (or the device refused it).
    public var prefillBatch: Int?
    /// prefill_kv_b{T}, largest first.
    public var kvBatches: [Int]

    public init(context: Int, window: Int, ring: Int, prefillBatch: Int?, kvBatches: [Int]) {
        self.context = context
        self.window = window
        self.ring = ring
        self.prefillBatch = prefillBatch
        self.kvBatches = kvBatches.sorted(by: >)
    }

    /// Whether a write-then-attend batch of T at p0 is exactly causal (engine.batch_is_exact).
    public func batchIsExact(p0: Int, count T: Int) -> Bool {
        if p0 + T > context { return false }
        return T == 1 || p0 + T <= ring || (ring - window >= T - 1 && p0 % ring + T <= ring)
    }

    /// The steps (function, tokens) that feed `n` tokens from position p0 (engine.Engine.plan); `allLogits`: every
    /// position's logits are wanted (no KV-only batch then).
    public func plan(p0: Int, count n: Int, allLogits: Bool = false) -> [(String, Int)] {
        var steps: [(String, Int)] = [], p = p0, i = 0
        let small = kvBatches.min() ?? 0
        while i < n {
            let kv = allLogits
                ? nil
                : kvBatches.first { T in p % T == 0 && T <= n - i - 1 && p + T <= context && p % ring + T <= ring }
            if let kv {
                steps.append(("prefill_kv_b\(kv)", kv))
            } else if small > 0, !allLogits, p % small != 0, n - i - 1 - ((small - p % small) % small) >= small {
                steps.append(("infer", 1))  // toward alignment
            } else if let B = prefillBatch, B > 1, batchIsExact(p0: p, count: B),
                n - i - 1 >= B || (allLogits && n - i >= B)
            {
                steps.append(("prefill_b\(B)", B))
            } else {
                steps.append(("infer", 1))
            }
            p += steps[steps.count - 1].1
            i += steps[steps.count - 1].1
        }
        return steps
    }
}
