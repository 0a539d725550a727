import Foundation

/// One generation's draws from the head's logits, as the Python `Sampler` (gemma_ane/runtime/sampling.py) makes
/// them: the logits processors (repetition penalty, presence and frequency penalties, logit bias, the runtime's
/// bans) on fp32 values, then the sampler chain (temperature, top-k, top-p, min-p), then one draw from numpy's
/// PCG64 stream through `Generator.choice`'s arithmetic. Same order, same float32 and float64 steps and the same
/// reductions, so one seed gives the Python runtime's tokens. Holds the stream and the token counts: one Sampler
/// per generation, `observe` each token emitted.
public struct Sampler: Sendable {
    public let options: SamplingOptions
    private var random: PCG64
    private var counts: [Int: Int] = [:]
    private let steps: [Step]
    /// Float32 additions per token id: logit bias (a ban is -inf) then the runtime's bans, applied in that order.
    private let bias: [(id: Int, add: Float)]
    private let bans: [Int]
    private let fixedMax: Int?
    private var row: [Float] = []

    private enum Step {
        case temperature(Double), topK(Int), topP(Double), minP(Double)
    }

    /// `history`: tokens already in the context that the penalties count (the Python sampler's `history`);
    /// `bans`: tokens no draw may take whatever the options say (tool_choice "none" bans `<|tool_call>`).
    public init(options: SamplingOptions, history: [Int] = [], bans: [Int] = []) throws {
        try options.validate()
        self.options = options
        random = PCG64(seed: options.seed ?? UInt64.random(in: .min ... .max))
        bias = options.logitBias.keys.sorted().map { id in
            let b = options.logitBias[id]!
            return (id, b == SamplingOptions.ban ? -Float.infinity : Float(b))
        }
        self.bans = Array(Set(bans)).sorted()
        fixedMax = (bias.map(\.id) + self.bans).max()
        steps = Self.chain(options)
        for token in history { counts[token, default: 0] += 1 }
    }

    /// make_sampler's chain: only the steps that change the distribution.
    private static func chain(_ p: SamplingOptions) -> [Step] {
        if p.isGreedy { return [] }  // greedy is the argmax alone (top-k 1), taken in draw
        var out: [Step] = p.temperature != 1.0 ? [.temperature(p.temperature)] : []
        if p.topK > 0 { out.append(.topK(p.topK)) }
        if p.topP < 1.0 { out.append(.topP(p.topP)) }
        if p.minP > 0 { out.append(.minP(p.minP)) }
        return out
    }

    /// `token` was emitted: counted for the penalties.
    public mutating func observe(_ token: Int) {
        counts[token, default: 0] += 1
    }

    /// The next token id from one position's logits (fp16 values widened to Float, or fp32); not modified.
    public mutating func sample(_ logits: [Float]) throws -> Int {
        try logits.withUnsafeBufferPointer { try sample($0) }
    }

    public mutating func sample(_ logits: UnsafeBufferPointer<Float>) throws -> Int {
        let vocabulary = logits.count
        guard vocabulary > 0 else { throw GemmaANEError(.device, "the head returned no logits") }
        if let top = fixedMax, top >= vocabulary {
            throw GemmaANEError(.input, "logit_bias: token \(top) is not in the vocabulary of \(vocabulary)")
        }
        let penalised = !counts.isEmpty
            && (options.repetitionPenalty != 1.0 || options.presencePenalty != 0 || options.frequencyPenalty != 0)
        guard penalised || !bias.isEmpty || !bans.isEmpty else { return try draw(logits) }
        // One copy of the row (a megabyte at 262,144 tokens, cheaper than any conversion) that the processors
        // then change at the few tokens they touch.
        if row.count != vocabulary { row = [Float](repeating: 0, count: vocabulary) }
        _ = row.withUnsafeMutableBufferPointer { $0.update(fromContentsOf: logits) }
        adjust()
        return try row.withUnsafeBufferPointer { try draw($0) }
    }

    /// The processors in make_logits_processors' order, each in the Python processor's float32 arithmetic.
    private mutating func adjust() {
        let p = options
        let vocabulary = row.count
        if p.repetitionPenalty != 1.0 || p.presencePenalty != 0 || p.frequencyPenalty != 0 {
            let r = Float(p.repetitionPenalty), presence = Float(p.presencePenalty)
            let frequency = Float(p.frequencyPenalty)
            for (id, count) in counts where id >= 0 && id < vocabulary && count > 0 {
                var x = row[id]
                if p.repetitionPenalty != 1.0 { x = x > 0 ? x / r : x * r }
                if p.presencePenalty != 0 || p.frequencyPenalty != 0 {
                    x = x - (presence + frequency * Float(count))  // a seen token: presence times 1
                }
                row[id] = x
            }
        }
        for (id, add) in bias { row[id] += add }
        for id in bans { row[id] += -Float.infinity }
    }

    /// The sampler chain over the adjusted row, then the draw (none when greedy).
    private mutating func draw(_ x: UnsafeBufferPointer<Float>) throws -> Int {
        if options.isGreedy { return Self.argmax(x) }
        var t: Float = 1
        var cut: Candidates?  // nil: the whole vocabulary, by id
        for step in steps {
            switch step {
            case .temperature(let value):
                // past fp32's largest, a temperature is as flat as that one
                t = Float(min(value, Double(Float.greatestFiniteMagnitude)))
            case .topK(let k):
                if let c = cut {
                    cut = Candidates(x: Array(c.x.prefix(k)), ids: Array(c.ids.prefix(k)), t: t)
                } else {
                    let ids = NumpyMath.topIndices(x, k)
                    cut = Candidates(x: ids.map { x[$0] }, ids: ids, t: t)
                }
            case .topP(let topP):
                var c = cut ?? head(x, t) { NumpyMath.sum($0) >= topP }
                let end = NumpyMath.searchsortedLeft(NumpyMath.cumsum(c.probabilities()), topP) + 1
                c.keep(Array(0..<min(end, c.ids.count)))
                cut = c
            case .minP(let minP):
                var c = cut ?? head(x, t) { p in p.isEmpty || p[p.count - 1] < minP * p[0] }
                let p = c.probabilities()
                c.keep(p.indices.filter { p[$0] >= minP * p[0] })
                cut = c
            }
        }
        guard var c = cut else {
            // nothing cut: one normalisation over the vocabulary
            let p = Self.softmax(x, top: x.max() ?? 0, t: t)
            return try pick(p)
        }
        let p = c.probabilities()
        let total = NumpyMath.sum(p)
        return c.ids[try pick(p.map { $0 / total })]
    }

    /// The first index of the largest value (top-k 1: ties by lower id).
    static func argmax(_ x: UnsafeBufferPointer<Float>) -> Int {
        var best = 0
        for i in 1..<max(x.count, 1) where x[i] > x[best] { best = i }
        return best
    }

    /// Candidates.head: the most likely tokens, as many as `enough` (shown their probabilities under the whole
    /// vocabulary's softmax, largest first) needs, the set growing fourfold from 64.
    private func head(_ x: UnsafeBufferPointer<Float>, _ t: Float, enough: ([Double]) -> Bool) -> Candidates {
        let m = x.max() ?? 0
        var total = 0.0
        let w = Self.weights(x, top: m, t: t)
        w.withUnsafeBufferPointer { total = NumpyMath.sum($0) }
        var n = 64
        while true {
            let ids = NumpyMath.topIndices(x, min(n, x.count))
            let probs = ids.map { exp(Double((x[$0] - m) / t)) / total }
            if enough(probs) || n >= x.count {  // (all of them taken: ends even on logits that are not numbers)
                return Candidates(x: ids.map { x[$0] }, ids: ids, t: t, p: probs)
            }
            n *= 4
        }
    }

    /// exp((x - top) / t), the subtraction and division in float32 and the exponential in float64, as numpy.
    private static func weights(_ x: UnsafeBufferPointer<Float>, top: Float, t: Float) -> [Double] {
        [Double](unsafeUninitializedCapacity: x.count) { out, initialized in
            for i in 0..<x.count { out[i] = exp(Double((x[i] - top) / t)) }
            initialized = x.count
        }
    }

    private static func softmax(_ x: UnsafeBufferPointer<Float>, top: Float, t: Float) -> [Double] {
        let w = weights(x, top: top, t: t)
        let total = NumpyMath.sum(w)
        return w.map { $0 / total }
    }

    /// `Generator.choice(len(p), p=p)`: the cumulative sum normalised by its last value, one double from the
    /// stream, and the first index whose cumulative probability exceeds it.
    private mutating func pick(_ p: [Double]) throws -> Int {
        var cdf = NumpyMath.cumsum(p)
        // numpy refuses such probabilities too: every token banned, or logits that are not numbers
        guard let last = cdf.last, last.isFinite, last > 0 else {
            throw GemmaANEError(.input, "sampling: no token left to draw (every candidate banned, or logits not finite)")
        }
        for i in cdf.indices { cdf[i] /= last }
        return NumpyMath.searchsortedRight(cdf, random.nextDouble())
    }

    /// The distribution as the chain narrows it: the logits `x` of the tokens `ids` (most likely first) at
    /// temperature `t`, and `p`, their probabilities under the distribution they were cut from (top-k's own, or
    /// the whole vocabulary's), kept by the cuts after it and renormalised by the draw.
    private struct Candidates {
        var x: [Float]
        var ids: [Int]
        var t: Float
        var p: [Double]?

        mutating func probabilities() -> [Double] {
            if let p { return p }
            guard let top = x.first else { return [] }  // logits that are not numbers leave no candidate
            let w = x.map { exp(Double(($0 - top) / t)) }
            let total = NumpyMath.sum(w)
            let p = w.map { $0 / total }
            self.p = p
            return p
        }

        mutating func keep(_ kept: [Int]) {
            let p = probabilities()
            x = kept.map { x[$0] }
            ids = kept.map { ids[$0] }
            self.p = kept.map { p[$0] }
        }
    }
}
