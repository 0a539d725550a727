import Foundation

/// How a generation went (the Python runtime's `Stats`): on its `.finish` event.
public struct GenerationStats: Sendable, Equatable {
    /// "stop" (a stop token), "length" (max tokens or the context), "cancelled".
    public var finishReason: String
    public var promptTokens: Int
    /// Prompt tokens whose caches were kept from the turn before: not processed again.
    public var reusedTokens: Int
    public var generatedTokens: Int
    /// Seconds: prompt processing and the first draw.
    public var timeToFirstToken: Double
    public var prefillTokensPerSecond: Double
    /// Tokens after the first, per second.
    public var decodeTokensPerSecond: Double
}

/// One step of a streamed generation.
public enum GenerationEvent: Sendable, Equatable {
    /// A token was drawn (its id) and the text it completed (often empty: a character may span tokens).
    case token(id: Int, text: String)
    /// Text with no token of its own: what the detokenizer held when the generation reached its length.
    case text(String)
    /// The generation ended: why, and its counts and speeds.
    case finish(GenerationStats)
}

/// One generation's options: the sampling fields as one value, the token budget, the prompt's shape.
public struct GenerateOptions: Sendable, Equatable {
    /// nil: the bundle's generation_config.json defaults.
    public var sampling: SamplingOptions?
    public var maxTokens: Int
    public var system: String?
    public var enableThinking: Bool
    /// The prompt is the caller's own formatting, control tokens included (no chat template; `<bos>` first).
    public var raw: Bool

    public init(
        sampling: SamplingOptions? = nil, maxTokens: Int = 256, system: String? = nil, enableThinking: Bool = false,
        raw: Bool = false
    ) {
        self.sampling = sampling
        self.maxTokens = maxTokens
        self.system = system
        self.enableThinking = enableThinking
        self.raw = raw
    }
}
