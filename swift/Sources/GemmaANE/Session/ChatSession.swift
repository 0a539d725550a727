import Foundation

/// A conversation with a bundle: each `respond(to:)` renders the whole conversation in Gemma 4's chat format and
/// streams the answer; the caches keep what the previous turn left, so only the new turn's tokens are processed
/// (prefix reuse, with the rings snapshotted at every turn's end). One session per conversation; its turns run one
/// at a time.
public final class ChatSession: @unchecked Sendable {
    public let model: GemmaModel
    /// The conversation so far (the system turn first, when there is one).
    public private(set) var messages: [ChatMessage]
    public var options: GenerateOptions
    private let lock = NSLock()

    public init(model: GemmaModel, options: GenerateOptions = GenerateOptions()) {
        self.model = model
        self.options = options
        messages = options.system.map { [.system($0)] } ?? []
    }

    /// Starts the conversation over (the caches keep what they hold: a new conversation reuses what it shares).
    public func reset() {
        lock.lock()
        messages = options.system.map { [.system($0)] } ?? []
        lock.unlock()
    }

    /// The answer to `text`, streamed: `.token` events as tokens are drawn, then `.finish`. Cancelling the consuming
    /// task stops the generation between batches of the prompt or between tokens; the answer so far is kept.
    public func respond(to text: String) -> AsyncThrowingStream<GenerationEvent, Error> {
        let stop = StopFlag()
        return AsyncThrowingStream { continuation in
            continuation.onTermination = { _ in stop.set() }
            // A thread of its own: chunk predictions block, and Swift's cooperative pool has one thread per core.
            Thread { [self] in
                do {
                    try self.turn(text, stop: stop) { event in
                        continuation.yield(event)
                        return !stop.isSet
                    }
                    continuation.finish()
                } catch {
                    continuation.finish(throwing: error)
                }
            }.start()
        }
    }

    /// One turn, synchronously: the answer's events to `onEvent` (return false to stop); the answer is appended.
    @discardableResult
    public func turn(_ text: String, stop: StopFlag = StopFlag(), onEvent: (GenerationEvent) -> Bool) throws -> GenerationStats {
        lock.lock()
        defer { lock.unlock() }
        let conversation = messages + [.user(text)]
        let (ids, marks) = try model.promptIds(conversation, tools: options.tools, enableThinking: options.enableThinking)
        var answer = "", reasoning = "", calls: [ToolCall] = []
        let stats = try model.generate(
            ids: ids, marks: marks, maxTokens: options.maxTokens, sampling: try model.sampling(options.sampling),
            stop: options.stop, toolNames: options.tools.isEmpty ? nil : Set(options.tools.map(\.name)),
            cancelled: { stop.isSet }
        ) { event in
            switch event {
            case .text(let piece): answer += piece
            case .reasoning(let piece): reasoning += piece
            case .toolCall(let call): calls.append(call)
            case .token, .finish: break
            }
            return onEvent(event)
        }
        messages = conversation + [.assistant(answer, reasoning: reasoning.isEmpty ? nil : reasoning, toolCalls: calls)]
        return stats
    }
}

/// A flag one thread sets and another reads: a generation's cancellation.
public final class StopFlag: @unchecked Sendable {
    private let lock = NSLock()
    private var value = false

    public init() {}

    public func set() {
        lock.lock()
        value = true
        lock.unlock()
    }

    public var isSet: Bool {
        lock.lock()
        defer { lock.unlock() }
        return value
    }
}
