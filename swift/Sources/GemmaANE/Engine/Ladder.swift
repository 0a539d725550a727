import Foundation

/// A bundle's context ladder at run time (CONTRACT §3a; `gemma_ane/runtime/ladder.py`): each rung's functions
/// presented under their plain names, so the engine drives any rung as a single-context bundle, and climbs by
/// swapping one rung's runners for the next's.
public struct Ladder: Sendable, Equatable {
    /// The rungs, ascending; the last is the top, carried under the plain names.
    public let contexts: [Int]
    public var top: Int { contexts[contexts.count - 1] }

    /// (the rung's context, the plain function) of a chunk function's name: `ctx{C}_{f}`, or (nil, name) for the top's.
    public static func split(_ name: String) -> (Int?, String) {
        guard name.hasPrefix("ctx"), let cut = name.firstIndex(of: "_"),
            let c = Int(name[name.index(name.startIndex, offsetBy: 3)..<cut]), c > 0, name[name.index(after: cut)...].count > 0
        else { return (nil, name) }
        return (c, String(name[name.index(after: cut)...]))
    }

    /// The ladder chunk_1's functions carry, or nil when they carry one context (bundle.ladder.rungs_of).
    public init?(interfaces: [String: FunctionInterface]) {
        guard let top = interfaces["infer"]?.inputs.first(where: { $0.name == "causal_mask_full" })?.shape.last else { return nil }
        let rungs = Set(interfaces.keys.compactMap { Self.split($0).0 }).union([top]).sorted()
        if rungs.count < 2 { return nil }
        contexts = rungs
    }

    /// The smallest rung that holds `positions` (the top one when none does: the caller refuses past it).
    public func rung(for positions: Int) -> Int {
        contexts.first { $0 >= positions } ?? top
    }

    /// The runners as the rung of `context` presents them, their infer functions loaded.
    func runners(_ raw: [ChunkRunner], context: Int) throws -> [RungRunner] {
        let rung = raw.map { RungRunner($0, context: context, top: top) }
        for r in rung { try r.load("infer") }
        return rung
    }
}

/// One climb: from rung `before` to `after` at `position`, and what it cost (seconds).
public struct Crossing: Sendable, Equatable {
    public var before: Int
    public var after: Int
    public var position: Int
    /// Loading the new rung's infer functions.
    public var loadSeconds: Double
    /// Making its states and copying the written prefix of every context-sized one.
    public var copySeconds: Double

    public var description: String {
        "context \(before) -> \(after) at position \(position) (load \(Int((loadSeconds * 1e3).rounded())) ms, copy \(Int((copySeconds * 1e3).rounded())) ms)"
    }
}

/// One chunk as one rung presents it: the rung's functions under their plain names, its own states.
final class RungRunner: ChunkRunner {
    let chunk: ChunkRunner
    let context: Int
    /// plain name -> the chunk's name for it on this rung.
    let names: [String: String]
    let name: String
    let functionNames: [String]
    let interfaces: [String: FunctionInterface]

    init(_ chunk: ChunkRunner, context: Int, top: Int) {
        self.chunk = chunk
        self.context = context
        name = chunk.name
        var names: [String: String] = [:], order: [String] = []
        for full in chunk.functionNames {
            let (rung, plain) = Ladder.split(full)
            if (rung ?? top) == context {
                names[plain] = full
                order.append(plain)
            }
        }
        self.names = names
        functionNames = ["infer"] + order.filter { $0 != "infer" }
        interfaces = names.compactMapValues { chunk.interfaces[$0] }
    }

    func load(_ function: String) throws { try chunk.load(names[function] ?? function) }
    func makeState(_ function: String) throws -> ChunkState? { try chunk.makeState(names[function] ?? function) }
    func predict(_ function: String, inputs: [String: Tensor], state: ChunkState?) throws -> [String: Tensor] {
        try chunk.predict(names[function] ?? function, inputs: inputs, state: state)
    }
    func readState(_ state: ChunkState, name: String) throws -> Tensor { try chunk.readState(state, name: name) }
    func writeState(_ state: ChunkState, name: String, _ tensor: Tensor) throws { try chunk.writeState(state, name: name, tensor) }
    func release(_ functions: [String]) { chunk.release(functions.map { names[$0] ?? $0 }) }
}
