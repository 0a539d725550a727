import Foundation
import Testing
@testable import GemmaANE

/// A ChatSession over the stub bundle: its head's zero logits make greedy draws of token 0 (<pad>, no stop), so a
/// turn runs to its max tokens; its caches are the stubs', so a second turn's reuse is the engine's own.
func stubSession(maxTokens: Int, beforeHead: (() -> Void)? = nil) throws -> ChatSession {
    let geometry: [BundleJSON] = [.int(64), .int(16), .int(16), .int(4), .array([.int(8)]), .null]
    let (bundle, runners) = try stubBundle(geometry)
    runners[1].beforePredict = beforeHead
    let model = try GemmaModel(bundle: bundle, runners: runners)
    return ChatSession(model: model, options: GenerateOptions(sampling: SamplingOptions(temperature: 0), maxTokens: maxTokens))
}

@Test func sessionStreamsATurnAndTheNextReusesIt() async throws {
    let session = try stubSession(maxTokens: 3)
    var tokens: [Int] = [], finish: GenerationStats?
    for try await event in session.respond(to: "hello") {
        if case .token(let id) = event { tokens.append(id) }
        if case .finish(let stats) = event { finish = stats }
    }
    #expect(tokens == [0, 0, 0])
    #expect(finish?.finishReason == "length" && finish?.generatedTokens == 3 && finish?.reusedTokens == 0)
    #expect(session.messages.map(\.role) == [.user, .assistant])
    var second: GenerationStats?
    for try await event in session.respond(to: "and again") {
        if case .finish(let stats) = event { second = stats }
    }
    // the first turn's prompt (and the answer's tokens fed after it) are reused up to where the rendering parts
    #expect((second?.reusedTokens ?? 0) > 0 && (second?.reusedTokens ?? 0) < (second?.promptTokens ?? 0))
    #expect(session.messages.count == 4)
}

@Test func sessionStopsWhenItsStreamIsDropped() async throws {
    // the head's third call (the third token's logits) waits until the consumer has left
    let left = DispatchSemaphore(value: 0)
    let calls = Counter()
    let session = try stubSession(maxTokens: 40) {
        if calls.next() == 3 { _ = left.wait(timeout: .now() + 60) }
    }
    var seen = 0
    for try await event in session.respond(to: "hello") {
        if case .token = event { seen += 1 }
        if seen == 2 { break }  // the consumer leaves: the stream terminates, the generation stops
    }
    left.signal()
    // the stopped turn keeps its partial answer: wait for it, then count what the caches hold
    for _ in 0..<600 where session.messages.count < 2 { try await Task.sleep(nanoseconds: 50_000_000) }
    #expect(session.messages.map(\.role) == [.user, .assistant])
    let prompt = try session.model.promptIds([.user("hello")]).ids.count
    // at most two tokens fed (the second is not when the consumer left before its event returned): not 40
    #expect(session.model.engine.position <= prompt + 2)
    let stats = try session.turn("next") { _ in true }
    #expect(session.messages.count == 4 && stats.reusedTokens > 0)
}

final class Counter: @unchecked Sendable {
    private let lock = NSLock()
    private var value = 0

    func next() -> Int {
        lock.lock()
        defer { lock.unlock() }
        value += 1
        return value
    }
}
