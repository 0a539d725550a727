import Foundation

/// model_config.json's text fields (CONTRACT §2), checked as the Python schema checks them
/// (`gemma_ane/bundle/schema.py`: TEXT_FIELDS, then TEXT_RELATIONS): one `.bundle` error
/// `FILE: field=value: expected ...` at the first field that breaks a rule.
public struct ModelConfig: Sendable, Equatable {
    public var vocabSize: Int
    public var hiddenSize: Int
    public var numHiddenLayers: Int
    public var perLayerDim: Int
    public var embedScale: Double
    public var perLayerEmbedScale: Double
    public var bosTokenId: Int?
    public var eosTokenId: Int?
    public var layerTypes: [String]?
    public var slidingWindow: Int?
    public var contextLength: Int?
    /// A context ladder's rungs, ascending, the last the context_length (CONTRACT §3a); nil: one context.
    public var contexts: [Int]?
    public var prefillBatch: Int?
    public var split: [Int]?
    /// Chunks other than the published three state their roles; the count is all the engine reads.
    public var chunkCount: Int?
    public var head: String?

    /// A context past this is no bundle's (schema.MAX_CONTEXT).
    public static let maxContext = 1 << 20
    static let quantizations = Set(["none", "fp16", "float16"] + (1...8).map { "int\($0)" })

    public init(json config: [String: BundleJSON], file: String) throws {
        func fail(_ name: String, _ what: String) -> GemmaANEError {
            GemmaANEError(.bundle, "\(file): \(name)=\(config[name]?.short ?? ""): expected \(what)")
        }
        func positive(_ v: BundleJSON) -> Bool { (v.int ?? 0) > 0 }
        func scale(_ v: BundleJSON) -> Bool {
            guard let d = v.number else { return false }
            return d > 0 && d <= Double(Float.greatestFiniteMagnitude)
        }
        func token(_ v: BundleJSON) -> Bool { (v.int ?? -1) >= 0 }
        // name, required, what, test: TEXT_FIELDS in its order, so the first field at fault is Python's
        let rules: [(String, Bool, String, (BundleJSON) -> Bool)] = [
            ("vocab_size", true, "a positive integer", positive),
            ("hidden_size", true, "a positive integer", positive),
            ("num_hidden_layers", true, "a positive integer", positive),
            ("per_layer_dim", true, "a positive integer", positive),
            ("embed_scale", true, "a positive fp32 number", scale),
            ("per_layer_embed_scale", true, "a positive fp32 number", scale),
            ("bos_token_id", false, "a token id", token),
            ("eos_token_id", false, "a token id", token),
            ("layer_types", false, "a list of strings", { $0.array?.allSatisfy { $0.string != nil } ?? false }),
            ("sliding_window", false, "a positive integer", positive),
            (
                "context_length", false, "a positive integer, at most \(Self.maxContext)",
                { positive($0) && ($0.int ?? 0) <= Self.maxContext }
            ),
            (
                "contexts", false, "ascending multiples of 32, at most \(Self.maxContext)",
                { v in
                    guard let a = v.array?.map({ $0.int ?? 0 }), a.count >= 2, a.allSatisfy({ $0 > 0 && $0 % 32 == 0 }) else { return false }
                    return zip(a, a.dropFirst()).allSatisfy { $0 < $1 } && a[a.count - 1] <= Self.maxContext
                }
            ),
            ("prefill_batch", false, "a positive integer", positive),
            (
                "split", false, "ascending layer indices",
                { v in
                    guard let a = v.array?.map({ $0.int ?? 0 }), !a.isEmpty, a.allSatisfy({ $0 > 0 }) else { return false }
                    return zip(a, a.dropFirst()).allSatisfy { $0 < $1 }
                }
            ),
            (
                "chunks", false, "a list of chunk entries, one per chunk_N, each with its name",
                { v in
                    guard let a = v.array else { return false }
                    return a.count >= 2 && a.allSatisfy { $0.object?["name"] != nil }
                }
            ),
            ("head", false, "\"logits\" or \"token_id\"", { $0 == .string("logits") || $0 == .string("token_id") }),
            ("weights", false, "an object: quant, bits, group_size, group_axis, keep (how linear weights were compressed)", { $0.object != nil }),
            ("rms_norm_eps", false, "a positive fp32 number", scale),
            ("final_logit_softcapping", false, "a positive fp32 number", { $0 == .null || scale($0) }),
            (
                "quantization", false, "\"none\", \"fp16\" or \"intN\" (N bits, 1 to 8)",
                { Self.quantizations.contains($0.string ?? "") }
            ),
        ]
        for (name, required, what, ok) in rules {
            guard let value = config[name] else {
                if required { throw GemmaANEError(.bundle, "\(file): \(name): missing") }
                continue
            }
            // a token id is also checked against the vocabulary, and its message says so whichever rule failed
            let vocab = config["vocab_size"]?.int ?? 0
            let isToken = name.hasSuffix("_token_id")
            if !ok(value) || isToken && (value.int ?? 0) >= vocab {
                throw fail(name, isToken ? "\(what) below vocab_size \(vocab)" : what)
            }
        }
        // the rules the Python schema checks once the fields above are sound (TEXT_RELATIONS)
        let layers = config["num_hidden_layers"]?.int ?? 0
        if let types = config["layer_types"]?.array, types.count != layers {
            throw fail("layer_types", "one per layer, as many as num_hidden_layers \(layers)")
        }
        if let split = config["split"]?.array, (split.last?.int ?? 0) > layers {
            throw fail("split", "boundaries up to num_hidden_layers \(layers)")
        }
        if let rungs = config["contexts"]?.array, config["context_length"]?.int != rungs.last?.int {
            throw fail("contexts", "rungs whose largest is the context_length")
        }
        vocabSize = config["vocab_size"]?.int ?? 0
        hiddenSize = config["hidden_size"]?.int ?? 0
        numHiddenLayers = layers
        perLayerDim = config["per_layer_dim"]?.int ?? 0
        embedScale = config["embed_scale"]?.number ?? 0
        perLayerEmbedScale = config["per_layer_embed_scale"]?.number ?? 0
        bosTokenId = config["bos_token_id"]?.int
        eosTokenId = config["eos_token_id"]?.int
        layerTypes = config["layer_types"]?.array?.compactMap(\.string)
        slidingWindow = config["sliding_window"]?.int
        contextLength = config["context_length"]?.int
        contexts = config["contexts"]?.array?.compactMap(\.int)
        prefillBatch = config["prefill_batch"]?.int
        split = config["split"]?.array?.compactMap(\.int)
        chunkCount = config["chunks"]?.array?.count
        head = config["head"]?.string
    }
}
