import Foundation
import GemmaANE
@testable import GemmaANECoreML
import Testing

#if canImport(CoreML)
    import CoreML
#else
    import CoreMLStandIn
#endif

/// The Core ML runner against the Python MIL executor's PipeRunner on the same tiny bundle: on Linux through the
/// Core ML stand-in (which pads every output's rows and refuses the functions it is told to), on a Mac through
/// Core ML itself. Serialized: the stand-in's refusals are process-wide.
@Suite(.serialized) struct CoreMLRunnerTests {
    static func bundle(_ name: String = "bundle") throws -> URL {
        try CoreMLFixtures.bundles().appendingPathComponent(name)
    }

    static func pipeRunners(_ name: String = "bundle") throws -> [PipeRunner] {
        try PipeRunner.open(bundle: bundle(name), python: CoreMLFixtures.python)
    }

    static func coreMLRunners(
        _ name: String = "bundle", units: MLComputeUnits = .cpuAndNeuralEngine, cache: URL? = nil
    ) async throws -> [CoreMLRunner] {
        let cache = cache ?? FileManager.default.temporaryDirectory.appendingPathComponent("coreml-cache-\(UUID())")
        var runners: [CoreMLRunner] = []
        for i in 1...3 {
            let package = try bundle(name).appendingPathComponent("chunk_\(i).mlpackage")
            runners.append(try await CoreMLRunner.open(package, computeUnits: units, cacheDirectory: cache))
        }
        return runners
    }

    /// Inputs for one call of `function`, as the interface declares them: positions 0, masks open, activations
    /// small and deterministic (varied per input, so no two inputs are equal).
    static func inputs(_ io: FunctionInterface, seed: UInt64 = 1) -> [String: Tensor] {
        var state = seed &* 0x9E37_79B9_7F4A_7C15
        var tensors: [String: Tensor] = [:]
        for spec in io.inputs {
            let count = spec.shape.reduce(1, *)
            let values: [Float] = (0..<count).map { _ in
                state = state &* 6_364_136_223_846_793_005 &+ 1_442_695_040_888_963_407
                return spec.dtype == .int32 || spec.name.hasPrefix("causal_mask") ? 0 : Float(state >> 40) / Float(1 << 24) - 0.5
            }
            tensors[spec.name] = Tensor(floats: values, shape: spec.shape, dtype: spec.dtype)
        }
        return tensors
    }

    /// The stand-in runs the executor itself, so its outputs are the executor's bit for bit; Core ML computes in
    /// its own fp16 order, so there the bound is fp16's (a few ulps of the largest magnitude).
    static func same(_ mine: Tensor?, _ theirs: Tensor) -> Bool {
        guard let mine, mine.shape == theirs.shape, mine.dtype == theirs.dtype else { return false }
        #if canImport(CoreML)
            let scale = max(theirs.floats.map(abs).max() ?? 0, 1)
            return zip(mine.floats, theirs.floats).allSatisfy { abs($0 - $1) <= 1e-2 * scale }
        #else
            return mine == theirs
        #endif
    }

    static func byName(_ specs: [TensorSpec]) -> [String: TensorSpec] {
        Dictionary(uniqueKeysWithValues: specs.map { ($0.name, $0) })
    }

    @Test func coreMLRunnerReadsTheInterfacesTheExecutorStates() async throws {
        let pipes = try Self.pipeRunners()
        let runners = try await Self.coreMLRunners()
        for (pipe, runner) in zip(pipes, runners) {
            #expect(runner.name == pipe.name)
            #expect(runner.functionNames.first == "infer")
            #expect(Set(runner.functionNames) == Set(pipe.functionNames))
            #expect(runner.functionNames.contains("prefill_b8") == pipe.functionNames.contains("prefill_b8"))
            for function in pipe.functionNames {
                let mine = try #require(runner.interfaces[function]), theirs = try #require(pipe.interfaces[function])
                #expect(Self.byName(mine.inputs) == Self.byName(theirs.inputs), "\(runner.name).\(function) inputs")
                #expect(Self.byName(mine.outputs) == Self.byName(theirs.outputs), "\(runner.name).\(function) outputs")
                #expect(Self.byName(mine.states) == Self.byName(theirs.states), "\(runner.name).\(function) states")
            }
        }
        #expect(runners[0].interfaces["infer"]?.states.isEmpty == false)
    }

    @Test func coreMLOutputsEqualTheExecutorsThroughPaddedStrides() async throws {
        let pipes = try Self.pipeRunners()
        let runners = try await Self.coreMLRunners()
        for (pipe, runner) in zip(pipes, runners) {
            for function in pipe.functionNames where function == "infer" || function == "prefill_b8" {
                let io = try #require(pipe.interfaces[function])
                let feed = Self.inputs(io, seed: UInt64(function.count))
                let theirs = try pipe.predict(function, inputs: feed, state: try pipe.makeState())
                let mine = try runner.predict(function, inputs: feed, state: try runner.makeState())
                #expect(Set(mine.keys) == Set(theirs.keys))
                for (name, tensor) in theirs {
                    #expect(Self.same(mine[name], tensor), "\(runner.name).\(function) output \(name)")
                }
            }
        }
        let logits = try #require(runners[2].interfaces["infer"]?.outputs.first { $0.name == "logits" })
        #expect(logits.dtype == .float16 && logits.shape.count >= 2)
    }

    @Test func coreMLStateSnapshotsRoundTrip() async throws {
        let runner = try await Self.coreMLRunners()[0]
        let io = try #require(runner.interfaces["infer"])
        let first = try #require(try runner.makeState())
        _ = try runner.predict("infer", inputs: Self.inputs(io, seed: 7), state: first)
        let copy = try #require(try runner.makeState())
        for spec in io.states {
            let written = try runner.readState(first, name: spec.name)
            #expect(written.shape == spec.shape && written.dtype == spec.dtype)
            #expect(written.bytes.contains { $0 != 0 }, "one step wrote \(spec.name)")
            #expect(try runner.readState(copy, name: spec.name).bytes.allSatisfy { $0 == 0 }, "a fresh state is zero")
            try runner.writeState(copy, name: spec.name, written)
            #expect(try runner.readState(copy, name: spec.name) == written)
        }
        // the restored state carries on exactly as the original does
        let next = Self.inputs(io, seed: 8)
        #expect(try runner.predict("infer", inputs: next, state: copy) == runner.predict("infer", inputs: next, state: first))
    }

    @Test func coreMLRefusesAnInputOfTheWrongShapeInOneLine() async throws {
        let runner = try await Self.coreMLRunners()[0]
        let io = try #require(runner.interfaces["infer"])
        var feed = Self.inputs(io)
        let spec = try #require(io.inputs.first { $0.dtype == .float16 })
        feed[spec.name] = Tensor(floats: [0, 0], shape: [2], dtype: .float16)
        let error = try #require(throws: GemmaANEError.self) {
            try runner.predict("infer", inputs: feed, state: try runner.makeState())
        }
        #expect(error.kind == .input && error.message.contains(spec.name))
        let missing = try #require(throws: GemmaANEError.self) {
            try runner.load("prefill_b99")
        }
        #expect(missing.kind == .input && missing.message.contains("prefill_b99"))
    }

    /// Greedy tokens after `prompt` through an engine over `runners`: the argmax of the logits, or the argmax
    /// head's own token.
    static func greedy(_ model: ModelBundle, _ runners: [ChunkRunner], count: Int = 12) throws -> [Int] {
        let prompt = [2, 105, 2364, 107, 40, 17, 300, 9, 81, 12, 106, 107, 105, 4368, 107].map {
            $0 % model.config.vocabSize
        }
        let engine = try Engine(bundle: model, runners: runners)
        var out = try engine.prompt(prompt).logits
        var tokens: [Int] = []
        for _ in 0..<count {
            let row = engine.head == "logits" ? Array(out.floats.suffix(model.config.vocabSize)) : []
            let next = engine.head == "logits"
                ? row.indices.max { row[$0] < row[$1] || (row[$0] == row[$1] && $0 > $1) } ?? 0
                : Int(out.floats.first ?? -1)
            tokens.append(next)
            out = try #require(try engine.feed([next]))
        }
        return tokens
    }

    @Test func coreMLGreedyTokensEqualThePipeRunners() async throws {
        let model = try ModelBundle(try Self.bundle())
        let theirs = try Self.greedy(model, Self.pipeRunners())
        let mine = try Self.greedy(model, await Self.coreMLRunners())
        #expect(mine == theirs)
        #expect(Set(theirs).count > 1, "a varied continuation, not one token repeated")
    }

    @Test func coreMLArgmaxHeadRunsGreedyOnlyAndSaysSo() async throws {
        let cache = FileManager.default.temporaryDirectory.appendingPathComponent("coreml-published-\(UUID())")
        let model = try await GemmaModel.load(try Self.bundle("published"), cacheDirectory: cache)
        #expect(model.engine.head == "token_id")
        #expect(try model.sampling(SamplingOptions(temperature: 0)).isGreedy)
        let error = try #require(throws: GemmaANEError.self) { try model.sampling(SamplingOptions(temperature: 0.7)) }
        #expect(error.kind == .input && error.message.contains("argmax"))
        #expect(throws: GemmaANEError.self) { try model.sampling(SamplingOptions(temperature: 0, logitBias: [3: 1])) }
        let bundle = try ModelBundle(try Self.bundle("published"))
        let theirs = try Self.greedy(bundle, Self.pipeRunners("published"))
        #expect(try Self.greedy(bundle, model.engine.runners) == theirs)
    }

    #if !canImport(CoreML)
        @Test func coreMLCompilesAPackageOnce() async throws {
            let cache = FileManager.default.temporaryDirectory.appendingPathComponent("coreml-once-\(UUID())")
            let package = try Self.bundle().appendingPathComponent("chunk_2.mlpackage")
            let before = StandInDevice.shared.compilations
            let first = try await CoreMLRunner.open(package, cacheDirectory: cache)
            let again = try await CoreMLRunner.open(package, cacheDirectory: cache)
            #expect(StandInDevice.shared.compilations == before + 1)
            #expect(first.compiledURL.path == again.compiledURL.path)
            #expect(first.compiledURL.path.hasPrefix(cache.path) && first.compiledURL.pathExtension == "mlmodelc")
            let elsewhere = try await CoreMLRunner.open(package, cacheDirectory: cache.appendingPathComponent("other"))
            #expect(StandInDevice.shared.compilations == before + 2)
            #expect(try await CoreMLRunner.open(elsewhere.compiledURL).compiledURL.path == elsewhere.compiledURL.path)
            #expect(StandInDevice.shared.compilations == before + 2, "a .mlmodelc loads as it is")
        }

        @Test func coreMLReportsAFunctionTheDeviceRefusesAsUnavailable() async throws {
            // every prompt function refused: the engine must fall back to infer for the whole prompt
            let refused = Set(try Self.pipeRunners()[0].functionNames.filter { $0 != "infer" })
            #expect(refused.contains("prefill_b8"))
            try await StandInDevice.shared.refusing(refused) {
                let runner = try await Self.coreMLRunners()[0]
                #expect(runner.functionNames.contains("prefill_b8"), "still stated: the engine plans, then falls back")
                let error = try #require(throws: GemmaANEError.self) { try runner.load("prefill_b8") }
                #expect(error.kind == .functionUnavailable)
                #expect(error.message.contains("prefill_b8") && error.message.contains("cpu_and_ne"))
                let io = try #require(runner.interfaces["infer"])
                _ = try runner.predict("infer", inputs: Self.inputs(io), state: try runner.makeState())
                let onCPU = try await Self.coreMLRunners(units: .cpuOnly)[0]
                try onCPU.load("prefill_b8")  // refused on the Neural Engine only
                // and the engine degrades to infer, saying so once
                var warnings: [String] = []
                let engine = try Engine(
                    bundle: ModelBundle(try Self.bundle()), runners: try await Self.coreMLRunners(),
                    warn: { warnings.append($0) })
                _ = try engine.prompt(Array(repeating: 7, count: 10))
                #expect(engine.history.allSatisfy { $0.function == "infer" })
                #expect(!warnings.isEmpty && warnings.allSatisfy { w in refused.contains { w.contains($0) } })
            }
            let runner = try await Self.coreMLRunners()[0]
            try runner.load("prefill_b8")
        }

        @Test func coreMLPacksStridedMultiArrays() throws {
            // a (2, 3) fp32 array stored column-major with a gap: strides (1, 4), the element (i, j) at i + 4j
            let values: [Float] = [0, 3, -1, -1, 1, 4, -1, -1, 2, 5]
            let memory = UnsafeMutableRawPointer.allocate(byteCount: values.count * 4, alignment: 16)
            memory.copyMemory(from: values, byteCount: values.count * 4)
            let array = try MLMultiArray(
                dataPointer: memory, shape: [2, 3], dataType: .float32, strides: [1, 4], deallocator: { $0.deallocate() })
            let packed = Tensor(shape: [2, 3], dtype: .float32, bytes: try Strided.pack(array, as: .float32))
            #expect(packed.floats == [0, 1, 2, 3, 4, 5])
            let zeroed = try MLMultiArray(
                dataPointer: UnsafeMutableRawPointer.allocate(byteCount: 40, alignment: 16), shape: [2, 3],
                dataType: .float32, strides: [1, 4], deallocator: { $0.deallocate() })
            try Strided.fill(zeroed, with: packed)
            #expect(try Strided.pack(zeroed, as: .float32) == packed.bytes)
        }
    #endif
}
