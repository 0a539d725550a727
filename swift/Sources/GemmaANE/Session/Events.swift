import Foundation

/// How a generation went (the Python runtime's `Stats`): on its `.finish` event.
public struct GenerationStats: Sendable, Equatable {
    /// "stop" (a stop token or string), "tool_calls", "length" (max tokens or the context), "cancelled".
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
    /// The context ladder's climbs during this generation (CONTRACT §3a), each as the Python runtime describes it.
    public var crossings: [String] = []
}

/// One step of a streamed generation. Each token drawn is a `.token` (its id), then what it released: answer
/// text, reasoning (the thought channel's text), a tool call once its closing token arrives; `.finish` last.
public enum GenerationEvent: Sendable, Equatable {
    case token(Int)
    case text(String)
    case reasoning(String)
    case toolCall(ToolCall)
    /// The generation ended: why ("stop", "tool_calls", "length", "cancelled"), and its counts and speeds.
    case finish(GenerationStats)
}

/// One generation's options: the sampling fields as one value, the token budget, the prompt's shape.
public struct GenerateOptions: Sendable, Equatable {
    /// nil: the bundle's generation_config.json defaults.
    public var sampling: SamplingOptions?
    public var maxTokens: Int
    public var system: String?
    public var enableThinking: Bool
    /// Strings that end the answer where they appear (at most 4), as the Python runtime's `stop`.
    public var stop: [String]
    /// Functions the model may call, declared in the system turn.
    public var tools: [ToolDefinition]
    /// The prompt is the caller's own formatting, control tokens included (no chat template; `<bos>` first).
    public var raw: Bool

    public init(
        sampling: SamplingOptions? = nil, maxTokens: Int = 256, system: String? = nil, enableThinking: Bool = false,
        raw: Bool = false, stop: [String] = [], tools: [ToolDefinition] = []
    ) {
        self.stop = stop
        self.tools = tools
        self.sampling = sampling
        self.maxTokens = maxTokens
        self.system = system
        self.enableThinking = enableThinking
        self.raw = raw
    }
}
