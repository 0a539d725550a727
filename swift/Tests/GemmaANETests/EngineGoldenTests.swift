import Foundation
import Testing
@testable import GemmaANE

/// tests/swift_goldens_engine.py's output, written once per test run by the Python package itself (the interpreter
/// from GEMMA_ANE_PYTHON, default .venv/bin/python at the package root); nothing golden is committed.
enum EngineGoldens {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent()

    static let written: Result<URL, GemmaANEError> = {
        let out = FileManager.default.temporaryDirectory.appendingPathComponent("gemma-ane-engine-goldens-\(UUID().uuidString)")
        let python = ProcessInfo.processInfo.environment["GEMMA_ANE_PYTHON"] ?? root.appendingPathComponent(".venv/bin/python").path
        guard FileManager.default.isExecutableFile(atPath: python) else {
            return .failure(GemmaANEError(.input, "\(python): no Python interpreter (run scripts/setup.sh or set GEMMA_ANE_PYTHON)"))
        }
        let process = Process()
        process.executableURL = URL(fileURLWithPath: python)
        process.arguments = [root.appendingPathComponent("tests/swift_goldens_engine.py").path, out.path]
        var environment = ProcessInfo.processInfo.environment
        environment["PYTHONPATH"] = root.path
        process.environment = environment
        do {
            try process.run()
        } catch {
            return .failure(GemmaANEError(.input, "\(python): cannot run (\(error))"))
        }
        process.waitUntilExit()
        guard process.terminationStatus == 0 else {
            return .failure(GemmaANEError(.input, "tests/swift_goldens_engine.py exited \(process.terminationStatus)"))
        }
        return .success(out)
    }()

    static func dir() throws -> URL { try written.get() }

    static func json() throws -> [String: BundleJSON] {
        try readJSONObject(try dir().appendingPathComponent("engine.json"))
    }
}

func floats(_ v: BundleJSON?) -> [Float] { (v?.array ?? []).map { Float($0.number ?? .nan) } }

@Test func hostRowsEqualPython() throws {
    let goldens = try EngineGoldens.json()
    let root = try EngineGoldens.dir().appendingPathComponent("host")
    let bundleConfig = root.appendingPathComponent("model_config.json")
    let config = try ModelConfig(json: try readJSONObject(bundleConfig), file: bundleConfig.path)
    let host = try HostTables(root: root, config: config)
    let embed = try #require(goldens["embed"]?.object)
    let (h, ple) = try host.embed((embed["ids"]?.array ?? []).compactMap(\.int))
    #expect(h == floats(embed["hidden"]))
    #expect(ple == floats(embed["ple"]))
    for rope in goldens["rope"]?.array ?? [] {
        let r = try #require(rope.object)
        let rows = try #require(host.ropeRows(r["type"]?.string ?? "", p0: r["p0"]?.int ?? 0, count: r["count"]?.int ?? 0))
        #expect(rows.cos == floats(r["cos"]))
        #expect(rows.sin == floats(r["sin"]))
    }
    #expect(throws: GemmaANEError.self) { try host.embed([config.vocabSize]) }
}

@Test func hostMasksEqualPython() throws {
    let goldens = try EngineGoldens.json()
    let cases = goldens["masks"]?.array ?? []
    #expect(cases.count > 5)
    for m in cases {
        let c = try #require(m.object)
        let (p0, T, w, r, ctx) = (c["p0"]?.int ?? 0, c["count"]?.int ?? 0, c["window"]?.int ?? 0, c["ring"]?.int ?? 0, c["context"]?.int ?? 0)
        #expect(Masks.full(p0: p0, count: T, context: ctx) == floats(c["full"]), "full \(p0) \(T)")
        #expect(Masks.sliding(p0: p0, count: T, window: w, ring: r) == floats(c["sliding"]), "sliding \(p0) \(T) \(w) \(r)")
        #expect(Masks.kvSliding(p0: p0, count: T, window: w, ring: r) == floats(c["kv"]), "kv \(p0) \(T) \(w) \(r)")
    }
}

@Test func bundleModelConfigRefusedAsPythonRefusesIt() throws {
    let cases = try EngineGoldens.json()["configs"]?.array ?? []
    #expect(cases.count > 10)
    for c in cases {
        let object = try #require(c.object?["config"]?.object)
        let expected = c.object?["error"]?.string
        do {
            _ = try ModelConfig(json: object, file: "model_config.json")
            #expect(expected == nil)
        } catch let e as GemmaANEError {
            #expect(e.message == expected)
            #expect(e.kind == .bundle)
        }
    }
}

@Test func enginePlansEqualPython() throws {
    let cases = try EngineGoldens.json()["plans"]?.array ?? []
    #expect(cases.count > 5)
    for p in cases {
        let c = try #require(p.object)
        let g = c["geometry"]?.array ?? []
        let paths = PromptPaths(
            context: g[0].int ?? 0, window: g[1].int ?? 0, ring: g[2].int ?? 0, prefillBatch: g[3].int,
            kvBatches: (g[4].array ?? []).compactMap(\.int))
        let steps = paths.plan(p0: c["p0"]?.int ?? 0, count: c["count"]?.int ?? 0, allLogits: c["all"] == .bool(true))
        let expected = (c["steps"]?.array ?? []).map { "\($0.array?[0].string ?? ""):\($0.array?[1].int ?? 0)" }
        #expect(steps.map { "\($0.0):\($0.1)" } == expected, "\(g) p0 \(c["p0"]?.int ?? 0)")
    }
}
