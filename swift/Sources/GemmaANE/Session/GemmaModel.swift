import Foundation

/// A loaded bundle an app generates with: the engine over its chunks, its tokenizer, its sampling defaults and
/// stop tokens. Generations run one at a time (the caches are one conversation's); `ChatSession` streams them.
public final class GemmaModel: @unchecked Sendable {
    public let bundle: ModelBundle
    public let engine: Engine
    public let tokenizer: BPETokenizer
    /// The ids that end a generation (CONTRACT §1).
    public let stopIds: Set<Int>
    private let lock = NSLock()

    /// A bundle run by `runners` (one per chunk, in order: Core ML's on a device, `PipeRunner.open` on Linux).
    public init(bundle: ModelBundle, runners: [ChunkRunner], warn: @escaping (String) -> Void = { _ in }) throws {
        self.bundle = bundle
        engine = try Engine(bundle: bundle, runners: runners, warn: warn)
        tokenizer = try BPETokenizer(contentsOf: bundle.root.appendingPathComponent(BundleLayout.tokenizer))
        stopIds = bundle.stopIds
    }

    #if os(macOS) || os(Linux)
    /// The bundle at `url` with its chunks run by the Python MIL executor (`python -m gemma_ane.mil.serve`), which
    /// `python` must be able to import.
    public static func load(_ url: URL, python: String, warn: @escaping (String) -> Void = { _ in }) throws -> GemmaModel {
        let bundle = try ModelBundle(url)
        return try GemmaModel(bundle: bundle, runners: try PipeRunner.open(bundle: bundle, python: python), warn: warn)
    }
    #endif

    /// The bundle's sampling defaults (generation_config.json; the Python defaults without one).
    public func defaultSampling() throws -> SamplingOptions {
        try SamplingOptions(
            generationConfig: bundle.generation.fields, file: bundle.root.appendingPathComponent(BundleLayout.generationConfig).path)
    }

    /// The sampling of one generation (nil: the bundle's defaults), checked against the vocabulary. The published
    /// argmax head runs greedy only, and says so.
    public func sampling(_ options: SamplingOptions?) throws -> SamplingOptions {
        let sampling = try options ?? defaultSampling()
        try sampling.validate(vocabularySize: bundle.config.vocabSize)
        if engine.head != "logits", !sampling.isGreedy || !sampling.logitBias.isEmpty {
            throw GemmaANEError(
                .input,
                "this bundle's last chunk returns only the argmax token (published layout): sampling and logit_bias are not possible; use temperature=0")
        }
        return sampling
    }

    /// The ids of `messages` in Gemma 4's chat format with the model's turn opened, and where their turns end
    /// (the positions the engine snapshots its rings at, so a later conversation that parts there reuses the rest).
    public func promptIds(
        _ messages: [ChatMessage], tools: [ToolDefinition] = [], enableThinking: Bool = false
    ) throws -> (ids: [Int], marks: [Int]) {
        let ids = try Gemma4Format.promptIDs(messages, tools: tools, enableThinking: enableThinking, tokenizer: tokenizer)
        return (ids, Self.turnEnds(ids, newline: tokenizer.encode("\n")))
    }

    /// Where the messages end in `ids` (model.turn_ends): after each `<turn|>` and its newline, after a message's
    /// calls (`<tool_call|><|tool_response>`) and after each result (`<tool_response|>`); the newest
    /// `Engine.maxSnapshots`, leaving out the last when only the generation prompt follows it.
    static func turnEnds(_ ids: [Int], newline: [Int]) -> [Int] {
        let turnClose = 106, toolCallClose = 49, toolResponseOpen = 50, toolResponseClose = 51
        let generationPrompt = 8  // "<|turn>model\n" and a thought channel's opening: no part point inside it
        var ends: [Int] = []
        for (i, t) in ids.enumerated() {
            let end: Int
            if t == turnClose {
                let after = ids[(i + 1)..<min(ids.count, i + 1 + newline.count)]
                end = i + 1 + (Array(after) == newline ? newline.count : 0)
            } else if t == toolResponseClose || (t == toolResponseOpen && i > 0 && ids[i - 1] == toolCallClose) {
                end = i + 1
            } else {
                continue
            }
            if end < ids.count { ends.append(end) }
        }
        if let last = ends.last, ids.count - last <= generationPrompt { ends.removeLast() }
        return Array(ends.suffix(Engine.maxSnapshots))
    }

    /// A raw prompt's ids: `<bos>` and the text, every control token it spells counted as one.
    public func rawPromptIds(_ text: String) -> [Int] {
        [bundle.config.bosTokenId ?? 2] + tokenizer.encode(text)
    }

    /// Generates from prompt ids, reusing what the caches hold of them, as the Python runtime's `_run` does; `onEvent`
    /// gets each event and returns false to stop. `marks`: where a later prompt may part from this one (its turns'
    /// ends), snapshotted. `stop`: stop strings; `toolNames`: the functions a call may name (nil: any).
    @discardableResult
    public func generate(
        ids: [Int], marks: [Int] = [], maxTokens: Int, sampling: SamplingOptions, stop: [String] = [],
        toolNames: Set<String>? = nil, cancelled: (() -> Bool)? = nil, onEvent: (GenerationEvent) -> Bool
    ) throws -> GenerationStats {
        lock.lock()
        defer { lock.unlock() }
        guard maxTokens >= 0 else { throw GemmaANEError(.input, "max_tokens=\(maxTokens): expected a non-negative integer") }
        if ids.count > engine.context {
            throw GemmaANEError(.input, "prompt of \(ids.count) tokens exceeds the context of \(engine.context)")
        }
        var parser = try OutputParser(tokenizer: tokenizer, stop: stop, toolNames: toolNames)
        let start = Date()
        let climbed = engine.crossings.count
        var (reused, logits) = try engine.prompt(ids, marks: marks, cancelled: cancelled)
        var sampler = try Sampler(options: sampling, history: ids.filter { $0 >= 0 })
        var generated = 0, finish: String?, firstToken: Date?
        func emit(_ token: Int, _ delta: OutputDelta) -> Bool {
            var go = onEvent(.token(token))
            if !delta.reasoning.isEmpty { go = onEvent(.reasoning(delta.reasoning)) && go }
            if !delta.content.isEmpty { go = onEvent(.text(delta.content)) && go }
            for call in delta.toolCalls { go = onEvent(.toolCall(call)) && go }
            return go
        }
        while generated < maxTokens {
            if let cancelled, cancelled() {
                finish = "cancelled"
                break
            }
            let values = logits.floats
            let token = engine.head == "logits" ? try sampler.sample(values) : Int(values.first ?? 0)
            sampler.observe(token)
            firstToken = firstToken ?? Date()
            generated += 1
            if stopIds.contains(token) {
                finish = parser.toolCalls.isEmpty ? "stop" : "tool_calls"
                _ = emit(token, parser.finish())
                break
            }
            if !emit(token, parser.push(token)) {
                finish = "cancelled"
                break
            }
            if parser.stopped {
                finish = "stop"
                break
            }
            // the context holds the prompt and every token but this one, which is not fed
            if generated >= maxTokens || ids.count + generated > engine.context { break }
            guard let next = try engine.feed([token]) else { throw GemmaANEError(.device, "the head returned nothing") }
            logits = next
        }
        if finish == nil {
            finish = "length"
            let tail = parser.finish().content
            if !tail.isEmpty { _ = onEvent(.text(tail)) }
        }
        let end = Date()
        let ttft = (firstToken ?? end).timeIntervalSince(start), decode = end.timeIntervalSince(firstToken ?? end)
        let stats = GenerationStats(
            finishReason: finish ?? "length", promptTokens: ids.count, reusedTokens: reused, generatedTokens: generated,
            timeToFirstToken: firstToken == nil ? 0 : ttft,
            prefillTokensPerSecond: firstToken != nil && ttft > 0 ? Double(ids.count - reused) / ttft : 0,
            decodeTokensPerSecond: generated > 1 && decode > 0 ? Double(generated - 1) / decode : 0,
            crossings: engine.crossings[climbed...].map(\.description))
        _ = onEvent(.finish(stats))
        return stats
    }
}
