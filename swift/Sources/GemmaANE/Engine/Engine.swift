import Foundation

/// The step driver (`gemma_ane/runtime/engine.py`'s Engine, in Swift): feeds token ids through any number of chunks
/// as CONTRACT §3 prescribes, and owns the rules of their caches (what a new prompt may reuse, ring snapshots).
///
/// The wiring is what the chunks declare: the stateful chunks come first and run every function on all the rows;
/// each hands on its hidden states, the first also the combined PLE, and any `kv{p}_k/v` outputs go to every later
/// chunk that takes them. The stateless chunks after them (the last with the head) run `infer` on the last row.
public final class Engine {
    /// The rings' state name (CONTRACT §3): the sliding caches, `ring` slots each.
    public static let ringState = "kv_cache_sliding"
    /// Ring snapshots kept (engine.MAX_SNAPSHOTS).
    public static let maxSnapshots = 4

    /// The rings (per chunk, state name -> contents) as they were at `position`; `top`: their newest write.
    struct Snapshot {
        var position: Int
        var rings: [[String: Tensor]]
        var top: Int
    }

    /// The chunks as the current rung presents them (a single-context bundle's: the runners given).
    public private(set) var runners: [ChunkRunner]
    /// The runners given, and the context ladder their functions carry (nil: one context).
    let raw: [ChunkRunner]
    public let ladder: Ladder?
    /// Every climb so far, oldest first.
    public private(set) var crossings: [Crossing] = []
    /// The optional functions dropped as not carried together: dropped on every rung.
    var dropped: Set<String> = []
    public let host: HostTables
    /// The functions each chunk carries once those not every chunk that needs them carries are dropped.
    public private(set) var functions: [[String: FunctionInterface]]
    public private(set) var paths: PromptPaths
    /// 1 + the drafts a verify call checks, when the bundle has a drafter (the reuse rule reads one row more then).
    public let verifyBatch: Int?
    /// "logits", or "token_id" for the published argmax head.
    public let head: String
    /// The most positions this engine holds: the top of a context ladder, which it climbs as a session grows.
    public var context: Int { ladder?.top ?? paths.context }
    /// The context the chunks run now.
    public var rung: Int { paths.context }
    let body: [Int]
    let tail: [Int]
    let kvPleWidth: Int?
    var loaded: Set<String> = ["infer"]
    /// Where warnings go (a dropped prompt function): once each, one line.
    let warn: (String) -> Void

    var states: [ChunkState?] = []
    public private(set) var position = 0
    /// The ids whose K/V the caches hold, in position order.
    public private(set) var tokens: [Int] = []
    var snapshots: [Snapshot] = []
    /// The newest position written into the rings.
    public private(set) var ringTop = -1
    /// The (function, tokens) of every step run since the caches last started over (for tests and plans).
    public private(set) var history: [(position: Int, function: String, count: Int)] = []

    /// An engine over `runners` (one per chunk, in order) with the bundle's host tables; its geometry is read off
    /// chunk_1's functions, the window from model_config.json (a ring padded for verify calls is wider).
    public init(bundle: ModelBundle, runners: [ChunkRunner], warn: @escaping (String) -> Void = { _ in }) throws {
        let root = bundle.root.path
        guard runners.count == bundle.chunkPaths.count else {
            throw GemmaANEError(.bundle, "\(root): \(bundle.chunkPaths.count) chunks, \(runners.count) runners")
        }
        raw = runners
        let ladder = Ladder(interfaces: runners[0].interfaces)
        if let want = bundle.config.contexts, want != ladder?.contexts ?? [] {
            let have = ladder?.contexts.map(String.init).joined(separator: ",") ?? "one context"
            throw GemmaANEError(
                .bundle, "\(root): contexts \(want.map(String.init).joined(separator: ",")) in model_config.json, but the chunks carry \(have)")
        }
        self.ladder = ladder
        // a ladder's engine starts on its smallest rung
        let runners: [ChunkRunner] = try ladder.map { try $0.runners(runners, context: $0.contexts[0]) } ?? runners
        self.runners = runners
        self.host = bundle.host
        self.warn = warn
        var functions = runners.map { $0.interfaces }
        for (r, f) in zip(runners, functions) where f["infer"] == nil {
            throw GemmaANEError(.bundle, "\(r.name): no function 'infer' (CONTRACT §3: every chunk has it)")
        }
        let stateful = functions.indices.filter { !(functions[$0]["infer"]?.states.isEmpty ?? true) }
        body = stateful
        tail = functions.indices.filter { !stateful.contains($0) }
        guard body == Array(0..<body.count), !tail.isEmpty else {
            throw GemmaANEError(
                .bundle, "\(root): chunks \(runners.map(\.name).joined(separator: ", ")): the stateful chunks must come first and the last must be stateless (it holds the head)")
        }
        // backend.carried_together: a function some chunk that needs it lacks is dropped from all, with one warning
        var optional: [String] = []
        for (i, r) in runners.enumerated() {
            for f in r.functionNames where f != "infer" && !optional.contains(f) && functions[i][f] != nil { optional.append(f) }
        }
        for function in optional {
            let needs = function.hasPrefix("verify_b") ? Array(runners.indices) : stateful
            let lacking = needs.filter { functions[$0][function] == nil }.map { runners[$0].name }
            if lacking.isEmpty { continue }
            dropped.insert(function)
            for i in functions.indices { functions[i][function] = nil }
            let path = function.hasPrefix("verify_b") ? "decoding runs without drafts" : "prompts run without it"
            warn("\(lacking.joined(separator: ", ")): no function '\(function)'; \(path)")
        }
        if let first = stateful.first, !functions[first].keys.contains(where: { $0.hasPrefix("prefill_") }) {
            warn("\(runners[first].name): no batched prompt function (prefill_b*, prefill_kv_b*); prompts run through infer one token at a time")
        }
        self.functions = functions
        // Engine.from_chunks: context and ring from chunk_1's masks
        let first = functions[0]
        guard let inputs = first["infer"]?.inputs,
            let ring = inputs.first(where: { $0.name == "causal_mask_sliding" })?.shape.last,
            let context = inputs.first(where: { $0.name == "causal_mask_full" })?.shape.last, ring > 0, context > 0
        else {
            throw GemmaANEError(.bundle, "\(runners[0].name): infer takes no causal_mask_sliding and causal_mask_full (CONTRACT §3)")
        }
        let batches = first.keys.compactMap { f in f.hasPrefix("prefill_b") ? Int(f.dropFirst("prefill_b".count)) : nil }.sorted()
        let kv = first.keys.compactMap { f in f.hasPrefix("prefill_kv_b") ? Int(f.dropFirst("prefill_kv_b".count)) : nil }.sorted()
        paths = PromptPaths(
            context: context, window: min(bundle.config.slidingWindow ?? ring, ring), ring: ring,
            prefillBatch: batches.last, kvBatches: kv)
        kvPleWidth = kv.first.flatMap { first["prefill_kv_b\($0)"]?.inputs.first { $0.name == "per_layer_raw" }?.shape.last }
        verifyBatch = first.keys.compactMap { f in f.hasPrefix("verify_b") ? Int(f.dropFirst("verify_b".count)) : nil }.first
        let last = functions[functions.count - 1]["infer"]?.outputs ?? []
        head = last.contains { $0.name == "logits" } ? "logits" : "token_id"
        for (layerType, tables) in host.rope where tables.cos.rows < context {
            throw GemmaANEError(
                .bundle, "\(root): RoPE table for \(layerType) has \(tables.cos.rows) rows, fewer than the context \(context)")
        }
        try reset()
    }

    /// Fresh, zeroed states: nothing cached.
    public func reset() throws {
        states = []
        states = try runners.map { try $0.makeState() }
        position = 0
        tokens = []
        history = []
        snapshots = []
        ringTop = -1
    }

    // -- the inputs of one call -------------------------------------------------------------------------

    /// The host's inputs for `ids` at p0, as Float tensors (each chunk gets them cast to what it declares).
    func inputs(_ ids: [Int], p0: Int, kvOnly: Bool = false) throws -> [String: Tensor] {
        let T = ids.count
        let (h, ple) = try host.embed(ids)
        let pleWidth = host.ple.columns
        var x: [String: Tensor] = [
            "hidden_states": Tensor(floats: h, shape: [1, T, host.embed.columns], dtype: .float32),
            "causal_mask_full": Tensor(
                floats: Masks.full(p0: p0, count: T, context: rung), shape: [1, 1, T, rung], dtype: .float32),
            "current_pos": Tensor(floats: [Float(p0)], shape: [1], dtype: .int32),
            "ring_pos": Tensor(floats: [Float(p0 % paths.ring)], shape: [1], dtype: .int32),
        ]
        if kvOnly, let width = kvPleWidth, width <= pleWidth {
            let cut = (0..<T).flatMap { t in ple[(t * pleWidth)..<(t * pleWidth + width)] }
            x["per_layer_raw"] = Tensor(floats: cut, shape: [1, T, width], dtype: .float32)
            x["causal_mask_sliding"] = Tensor(
                floats: Masks.kvSliding(p0: p0, count: T, window: paths.window, ring: paths.ring), shape: [1, 1, T, paths.ring + T],
                dtype: .float32)
        } else {
            x["per_layer_raw"] = Tensor(floats: ple, shape: [1, T, pleWidth], dtype: .float32)
            x["causal_mask_sliding"] = Tensor(
                floats: Masks.sliding(p0: p0, count: T, window: paths.window, ring: paths.ring), shape: [1, 1, T, paths.ring],
                dtype: .float32)
        }
        for (layerType, (c, s)) in [("sliding_attention", ("cos_s", "sin_s")), ("full_attention", ("cos_f", "sin_f"))] {
            if let rows = host.ropeRows(layerType, p0: p0, count: T), let width = host.rope[layerType]?.cos.columns {
                x[c] = Tensor(floats: rows.cos, shape: [1, 1, T, width], dtype: .float32)
                x[s] = Tensor(floats: rows.sin, shape: [1, 1, T, width], dtype: .float32)
            }
        }
        return x
    }

    /// Chunk i's `function` on the tensors it declares, each cast to its declared dtype.
    func predict(_ i: Int, _ function: String, _ x: [String: Tensor]) throws -> [String: Tensor] {
        guard let io = functions[i][function] else {
            throw GemmaANEError(.bundle, "\(runners[i].name): no function '\(function)'")
        }
        var feed: [String: Tensor] = [:]
        for spec in io.inputs {
            guard let t = x[spec.name] else {
                throw GemmaANEError(.bundle, "\(runners[i].name).\(function): takes \(spec.name), which no earlier chunk gives")
            }
            feed[spec.name] = t.cast(to: spec.dtype)
        }
        return try runners[i].predict(function, inputs: feed, state: states[i])
    }

    /// The stateful chunks' `function` on x, in order: x then holds the last one's hidden states (and the combined
    /// PLE) and every producer cache they returned. Returns what each returned.
    func runBody(_ function: String, _ x: inout [String: Tensor]) throws -> [(Int, [String: Tensor])] {
        var outs: [(Int, [String: Tensor])] = []
        var shared: [String: Tensor] = [:]
        for i in body {
            let out = try predict(i, function, x.merging(shared) { $1 })
            guard let hidden = out["hidden_states_out"] else {
                throw GemmaANEError(.bundle, "\(runners[i].name).\(function): no output hidden_states_out")
            }
            x["hidden_states"] = hidden
            if let ple = out["per_layer_combined_out"] { x["per_layer_combined"] = ple }
            for (k, v) in out where k.hasPrefix("kv") { shared[k] = v }
            outs.append((i, out))
        }
        x.merge(shared) { $1 }
        return outs
    }

    /// The stateless chunks on the last row: the head's logits, or the published head's token id, checked finite.
    func runTail(_ x: [String: Tensor], _ held: [(Int, [String: Tensor])]) throws -> Tensor {
        var feed = x, held = held, out: [String: Tensor] = [:]
        for i in tail {
            out = try predict(i, "infer", feed)
            if i != tail.last {
                guard let hidden = out["hidden_states_out"] else {
                    throw GemmaANEError(.bundle, "\(runners[i].name).infer: no output hidden_states_out")
                }
                feed["hidden_states"] = hidden
                held.append((i, out))
            }
        }
        let headName = runners[runners.count - 1].name
        guard let result = out[head] else { throw GemmaANEError(.bundle, "\(headName).infer: no output \(head)") }
        // the published head returns only the chosen id: its logit is all there is to check there
        let checked = head == "token_id" ? out["token_logit"] : result
        if let checked, !checked.isFinite {
            let bad = held.first { _, o in !o.values.allSatisfy(\.isFinite) }.map { runners[$0.0].name }
            let place = bad.map { "\($0) or before it" } ?? headName
            throw GemmaANEError(
                .bundle, "\(headName): logits hold NaN or inf (damaged weights in \(place)); run gemma-ane check, or re-convert")
        }
        return result
    }

    // -- running --------------------------------------------------------------------------------------

    /// Processes `ids` from the current position as planned; returns the last token's logits when `wantLogits`.
    /// A failure midway resets the caches (half-written caches are never reused); a cancellation, asked before
    /// each batch, leaves them holding exactly the batches run.
    @discardableResult
    public func feed(_ ids: [Int], wantLogits: Bool = true, cancelled: (() -> Bool)? = nil) throws -> Tensor? {
        if position + ids.count > context {
            throw GemmaANEError(.input, "\(position + ids.count) tokens exceed the context of \(context)")
        }
        try climb(position + ids.count)
        do {
            return try feedPlanned(ids, wantLogits, cancelled)
        } catch let e as GemmaANEError where e.kind == .cancelled {
            throw e
        } catch {
            try? reset()
            throw error
        }
    }

    private func feedPlanned(_ ids: [Int], _ wantLogits: Bool, _ cancelled: (() -> Bool)?) throws -> Tensor? {
        var result: Tensor?, i = 0
        for (function, T) in try readyPlan(ids.count) {
            if let cancelled, cancelled() {
                throw GemmaANEError(.cancelled, "cancelled after \(position) of the prompt's tokens")
            }
            let p = position, chunk = Array(ids[i..<(i + T)])
            var x = try inputs(chunk, p0: p, kvOnly: function.hasPrefix("prefill_kv"))
            let held = try runBody(function, &x)
            if !function.hasPrefix("prefill_kv"), T == 1, wantLogits, i == ids.count - 1 {
                result = try runTail(x, held)
            }
            position += T
            ringTop = max(ringTop, position - 1)
            history.append((p, function, T))
            tokens += chunk
            i += T
        }
        return result
    }

    /// The plan once every function it uses is loaded: a function a chunk cannot load leaves the prompt paths with
    /// one warning, and the plan is made again without it (engine._ready_plan).
    func readyPlan(_ n: Int) throws -> [(String, Int)] {
        while true {
            let steps = paths.plan(p0: position, count: n)
            var seen: Set<String> = []
            guard let function = steps.map(\.0).first(where: { seen.insert($0).inserted && !loaded.contains($0) }) else {
                return steps
            }
            do {
                for (i, r) in runners.enumerated() where functions[i][function] != nil { try r.load(function) }
                loaded.insert(function)
            } catch let e as GemmaANEError where e.kind == .functionUnavailable {
                if function == "prefill_b\(paths.prefillBatch ?? 0)" {
                    paths.prefillBatch = nil
                } else {
                    paths.kvBatches.removeAll { "prefill_kv_b\($0)" == function }
                }
                let batched = paths.kvBatches.map { "prefill_kv_b\($0)" } + (paths.prefillBatch.map { ["prefill_b\($0)"] } ?? [])
                let remaining = (batched + ["infer" + (batched.isEmpty ? " one token at a time" : "")]).joined(separator: ", ")
                warn("\(e.message); prompts run without it (\(remaining))")
            }
        }
    }

    // -- the context ladder (CONTRACT §3a) ------------------------------------------------------------------

    /// Before a call that fills the caches up to `positions`: onto the smallest rung that holds them, when the current
    /// one does not, carrying the caches over (engine._climb).
    func climb(_ positions: Int) throws {
        if let ladder, rung < positions, positions <= context { try switchRung(ladder.rung(for: positions), carry: true) }
    }

    /// Before fresh caches are filled with `positions` tokens: the smallest rung that holds them, up or down; the
    /// caches are empty, so nothing is carried (engine._start).
    func start(_ positions: Int) throws {
        if let ladder, ladder.rung(for: positions) != rung { try switchRung(ladder.rung(for: positions), carry: false) }
    }

    /// Runs the rung of `target` from now on: loads its infer functions, makes its states and (carry) copies in the
    /// written prefix of every context-sized cache (slot = position: the rows past it are masked, never read) and the
    /// rings as they are, then releases the rung left. Nothing changes if any of it fails.
    func switchRung(_ target: Int, carry: Bool) throws {
        guard let ladder else { return }
        let t0 = Date()
        let next = try ladder.runners(raw, context: target)
        let t1 = Date()
        let made = try next.map { try $0.makeState("infer") }
        if carry {
            for i in next.indices {
                guard let now = made[i], let was = states[i] else { continue }
                for spec in next[i].interfaces["infer"]?.states ?? [] {
                    var a = try runners[i].readState(was, name: spec.name)
                    if spec.name != Self.ringState {
                        a = try Self.prefix(a, rows: position, into: next[i].readState(now, name: spec.name))
                    }
                    try next[i].writeState(now, name: spec.name, a)
                }
            }
        }
        let t2 = Date()
        for r in runners { r.release(r.functionNames) }
        if carry {
            crossings.append(
                Crossing(
                    before: rung, after: target, position: position, loadSeconds: t1.timeIntervalSince(t0),
                    copySeconds: t2.timeIntervalSince(t1)))
        }
        runners = next
        states = made
        functions = next.map { r in r.interfaces.filter { !dropped.contains($0.key) } }
        paths.context = target
        loaded = ["infer"]
    }

    /// `into` with the first `rows` rows of axis 2 of `from` copied in (a context-sized cache [a, b, C, d...]).
    static func prefix(_ from: Tensor, rows: Int, into: Tensor) throws -> Tensor {
        guard from.shape.count >= 3, into.shape.count == from.shape.count, from.dtype == into.dtype,
            Array(from.shape[..<2]) == Array(into.shape[..<2]), Array(from.shape[3...]) == Array(into.shape[3...]),
            rows <= from.shape[2], rows <= into.shape[2]
        else {
            throw GemmaANEError(.bundle, "a context-sized state \(from.shape) cannot grow into \(into.shape)")
        }
        let row = from.shape[3...].reduce(1, *) * from.dtype.size
        let outer = from.shape[0] * from.shape[1]
        var bytes = into.bytes
        bytes.withUnsafeMutableBytes { dst in
            from.bytes.withUnsafeBytes { src in
                for o in 0..<outer {
                    let s = o * from.shape[2] * row, d = o * into.shape[2] * row
                    dst.baseAddress!.advanced(by: d).copyMemory(from: src.baseAddress!.advanced(by: s), byteCount: rows * row)
                }
            }
        }
        return Tensor(shape: into.shape, dtype: into.dtype, bytes: bytes)
    }

    // -- the cache rules ------------------------------------------------------------------------------

    /// Rewinds the caches to the longest prefix of `ids` they hold exactly and returns its length (0: they start
    /// over); the last token always runs again. The rings are the limit; a snapshot of them taken at a prompt end
    /// inside the common prefix takes their place when they no longer hold it (engine.reuse).
    public func reuse(_ ids: [Int]) throws -> Int {
        var common = 0
        for (a, b) in zip(tokens, ids) {
            if a != b { break }
            common += 1
        }
        common = min(common, ids.count - 1)
        var kept: Int
        if ringsHold(common, ringTop) {
            kept = common
        } else {
            let snap = snapshots.filter { $0.position <= common && ringsHold($0.position, $0.top) }.max { $0.position < $1.position }
            kept = snap?.position ?? 0
            if let snap {
                try writeRings(snap.rings)
                ringTop = snap.top
            }
        }
        if kept <= 0 {
            try reset()
            kept = 0
        } else {
            rewind(kept)
        }
        return kept
    }

    /// Whether rings whose newest write is `top` still hold every row a prefix of `kept` tokens needs.
    func ringsHold(_ kept: Int, _ top: Int) -> Bool {
        let reach = paths.window + (verifyBatch != nil ? 1 : 0)  // the drafter reads W + 1 rows
        return top < paths.ring || top < kept + paths.ring - reach + 1
    }

    /// Processes a prompt: reuses what the caches hold, feeds the rest, and snapshots the rings at its end and at
    /// each mark (where a later prompt may diverge, e.g. a turn's end). Returns (tokens reused, the last logits).
    public func prompt(_ ids: [Int], marks: [Int] = [], cancelled: (() -> Bool)? = nil) throws -> (reused: Int, logits: Tensor) {
        guard !ids.isEmpty else { throw GemmaANEError(.input, "prompt: no tokens") }
        if ids.count > context {
            throw GemmaANEError(.input, "prompt of \(ids.count) tokens exceeds the context of \(context)")
        }
        let kept = try reuse(ids)
        if kept == 0 { try start(ids.count) }
        let stops = Set(marks.filter { kept < $0 && $0 < ids.count } + [ids.count]).sorted()
        var logits: Tensor?
        for stop in stops {
            logits = try feed(Array(ids[position..<stop]), wantLogits: stop == ids.count, cancelled: cancelled)
            try snapshot()
        }
        guard let logits else { throw GemmaANEError(.device, "prompt: the head returned nothing") }
        return (kept, logits)
    }

    /// Keeps the rings as they are now (the newest maxSnapshots positions).
    func snapshot() throws {
        if position == 0 || snapshots.contains(where: { $0.position == position }) { return }
        snapshots.append(Snapshot(position: position, rings: try readRings(), top: ringTop))
        snapshots.sort { $0.position < $1.position }
        snapshots = Array(snapshots.suffix(Self.maxSnapshots))
    }

    func readRings() throws -> [[String: Tensor]] {
        try zip(runners, states).enumerated().map { i, pair in
            guard let state = pair.1, functions[i]["infer"]?.states.contains(where: { $0.name == Self.ringState }) == true else {
                return [:]
            }
            return [Self.ringState: try pair.0.readState(state, name: Self.ringState)]
        }
    }

    func writeRings(_ rings: [[String: Tensor]]) throws {
        for (i, arrays) in rings.enumerated() {
            guard let state = states[i] else { continue }
            for (name, t) in arrays { try runners[i].writeState(state, name: name, t) }
        }
    }

    /// Forgets everything from `position` on (the caller knows the rings hold the rest).
    public func rewind(_ position: Int) {
        self.position = position
        tokens = Array(tokens.prefix(position))
        history = history.filter { $0.position + $0.count <= position }
        snapshots = snapshots.filter { $0.position <= position }
    }
}
