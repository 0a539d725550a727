import Foundation

/// The sampling fields of one generation, mirroring the Python `SamplingParams` (gemma_ane/runtime/sampling.py):
/// the same fields, defaults, bounds and messages (fields named as Python names them, `top_k`), so an app's
/// options mean what the CLI's flags and the server's JSON fields mean.
public struct SamplingOptions: Sendable, Equatable {
    /// 0 decodes greedily.
    public var temperature: Double = 1.0
    /// Draw from the k most likely tokens only (0: all).
    public var topK: Int = 0
    /// Draw from the fewest most likely tokens holding this probability.
    public var topP: Double = 1.0
    /// Drop tokens less likely than this fraction of the most likely one.
    public var minP: Double = 0.0
    /// Divide positive, multiply negative logits of tokens seen.
    public var repetitionPenalty: Double = 1.0
    /// Subtract this from the logit of every token seen.
    public var presencePenalty: Double = 0.0
    /// Subtract this times its count from the logit of every token seen.
    public var frequencyPenalty: Double = 0.0
    /// The random stream's seed (nil: fresh entropy). A signed seed, as OpenAI clients send it, is its 64-bit
    /// two's complement (`UInt64(bitPattern:)`), as the Python sampler maps it.
    public var seed: UInt64?
    /// OpenAI's logit bias: token id -> bias in [-100, 100] added to its logit; -100 bans the token.
    public var logitBias: [Int: Double] = [:]

    public init(
        temperature: Double = 1.0, topK: Int = 0, topP: Double = 1.0, minP: Double = 0.0,
        repetitionPenalty: Double = 1.0, presencePenalty: Double = 0.0, frequencyPenalty: Double = 0.0,
        seed: UInt64? = nil, logitBias: [Int: Double] = [:]
    ) {
        self.temperature = temperature
        self.topK = topK
        self.topP = topP
        self.minP = minP
        self.repetitionPenalty = repetitionPenalty
        self.presencePenalty = presencePenalty
        self.frequencyPenalty = frequencyPenalty
        self.seed = seed
        self.logitBias = logitBias
    }

    /// The bundle's defaults from its generation_config.json (decoded JSON): `do_sample: false` means greedy, and
    /// temperature, top_k, top_p, min_p and repetition_penalty where it sets them, each checked by its field's
    /// rule; a bad one is blamed on the file (`file: field=value: why`), never on an option the caller never gave.
    public init(generationConfig config: [String: Any], file: String = "generation_config.json") throws {
        self.init()
        if isJSONFalse(config["do_sample"]) {
            temperature = 0
        }
        func number(_ name: String, integer: Bool = false) throws -> Double? {
            guard let value = config[name], !(value is NSNull) else { return nil }
            guard let number = jsonNumber(value), number.isFinite, !integer || number == number.rounded() else {
                let shown = (value as? NSNumber).map { isBoolean($0) ? ($0.boolValue ? "True" : "False") : "\($0)" } ?? "\(value)"
                throw GemmaANEError(.bundle, "\(file): \(name)=\(shown): expected \(integer ? "an integer" : "a number")")
            }
            return number
        }
        do {
            if let t = try number("temperature") { temperature = t }
            if let k = try number("top_k", integer: true) { topK = Int(max(-1, min(k, 1e15))) }
            if let p = try number("top_p") { topP = p }
            if let p = try number("min_p") { minP = p }
            if let r = try number("repetition_penalty") { repetitionPenalty = r }
            try validate()
        } catch let error as GemmaANEError where error.kind == .input {
            throw GemmaANEError(.bundle, "\(file): \(error.message)")
        }
    }

    /// Checks every field, and the logit bias's ids against `vocabularySize` when given: a `GemmaANEError(.input)`
    /// whose message opens with the field's Python name (`top_p=1.5: must be <= 1.0`).
    public func validate(vocabularySize: Int? = nil) throws {
        try check("temperature", temperature, lo: 0.0)
        if topK < 0 { throw fail("top_k=\(topK): must be >= 0") }
        try check("top_p", topP, lo: 0.0, hi: 1.0, loOpen: true)
        try check("min_p", minP, lo: 0.0, hi: 1.0)
        try check("repetition_penalty", repetitionPenalty, lo: 0.0, loOpen: true)
        try check("presence_penalty", presencePenalty, lo: -2.0, hi: 2.0)
        try check("frequency_penalty", frequencyPenalty, lo: -2.0, hi: 2.0)
        for token in logitBias.keys.sorted() {
            let bias = logitBias[token]!
            if token < 0 || (vocabularySize.map { token >= $0 } ?? false) {
                let of = vocabularySize.map { " of \($0)" } ?? ""
                throw fail("logit_bias: token \(token) is not in the vocabulary\(of)")
            }
            if !(-100...100).contains(bias) {
                throw fail("logit_bias: \(token): \(pythonRepr(bias)): expected a number in [-100, 100]")
            }
        }
        if let size = vocabularySize, logitBias.values.filter({ $0 == Self.ban }).count >= size {
            throw fail("logit_bias: it bans every token")
        }
    }

    /// OpenAI: "values like -100 or 100 should result in a ban or exclusive selection".
    static let ban = -100.0

    /// Greedy decoding: the argmax, no draw.
    public var isGreedy: Bool { temperature == 0 || topK == 1 }

    private func check(_ name: String, _ value: Double, lo: Double, hi: Double? = nil, loOpen: Bool = false) throws {
        let shown = pythonRepr(value)  // as Python's repr, so the messages are the Python runtime's
        guard value.isFinite else { throw fail("\(name)=\(shown): expected a number") }
        if loOpen ? value <= lo : value < lo { throw fail("\(name)=\(shown): must be \(loOpen ? ">" : ">=") \(pythonRepr(lo))") }
        if let hi, value > hi { throw fail("\(name)=\(shown): must be <= \(pythonRepr(hi))") }
    }

    private func fail(_ message: String) -> GemmaANEError { GemmaANEError(.input, message) }
}

/// JSON's `false` itself (Python's `is False`), not a 0 that Foundation would also bridge to a Bool.
func isJSONFalse(_ value: Any?) -> Bool {
    guard let value else { return false }
    if let number = value as? NSNumber, !isBoolean(number) { return false }
    return (value as? Bool) == false
}

/// Whether Foundation decoded this number from JSON's true or false.
func isBoolean(_ number: NSNumber) -> Bool {
    #if canImport(Darwin)
        return CFGetTypeID(number) == CFBooleanGetTypeID()
    #else
        return String(cString: number.objCType) == "c"  // swift-corelibs-foundation's __NSCFBoolean
    #endif
}

/// A JSON number as Foundation decodes it (Int, Double or NSNumber), never a Bool (Python refuses `true` as 1).
func jsonNumber(_ value: Any) -> Double? {
    if let number = value as? NSNumber {
        return isBoolean(number) ? nil : number.doubleValue
    }
    if value is Bool { return nil }
    if let int = value as? Int { return Double(int) }
    if let double = value as? Double { return double }
    return nil
}
