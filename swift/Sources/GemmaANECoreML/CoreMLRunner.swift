#if canImport(CoreML)
    import CoreML
#else
    import CoreMLStandIn
#endif
import Foundation
import GemmaANE

/// A chunk's `MLState`: its KV caches, made by the default function's model and shared by every function of the
/// chunk (Core ML lets `infer` and `prefill_b8` of one package write one state).
final class CoreMLState: ChunkState {
    let state: MLState

    init(_ state: MLState) {
        self.state = state
    }
}

extension MLComputeUnits {
    /// The Python CLI's names for compute units (`--compute-units`), for messages and options.
    public static let names: [(String, MLComputeUnits)] = [
        ("cpu_and_ne", .cpuAndNeuralEngine), ("cpu_only", .cpuOnly), ("cpu_and_gpu", .cpuAndGPU), ("all", .all),
    ]

    public init(named name: String) throws {
        guard let units = Self.names.first(where: { $0.0 == name })?.1 else {
            let choices = Self.names.map(\.0).joined(separator: ", ")
            throw GemmaANEError(.input, "--compute-units \(name): choose one of \(choices)")
        }
        self = units
    }

    var name: String { Self.names.first(where: { $0.1 == self })?.0 ?? "these compute units" }
}

/// One chunk package run by Core ML: the Swift mirror of the Python `CoreMLBackend` (gemma_ane/runtime/backend.py).
/// One `MLModel` per function, each loaded from the one compiled model with `MLModelConfiguration.functionName`;
/// only `infer` is loaded when the runner opens. Every other function loads on first use, since each load
/// compiles for the device and a device may refuse one (the ANE compiler fails some stateful T > 1 functions on
/// A19 Pro): that costs the prompt path (`.functionUnavailable`, which the engine falls back from), not the model.
public final class CoreMLRunner: ChunkRunner {
    public let name: String
    public let functionNames: [String]
    public let interfaces: [String: FunctionInterface]
    public let computeUnits: MLComputeUnits
    /// The compiled model every function loads from (the cached compilation of a `.mlpackage`).
    public let compiledURL: URL
    /// False for a package of one function (the published layout's): it loads as the default function.
    private let multifunction: Bool
    private let infer: MLModel
    private var models: [String: MLModel]

    /// Opens `url` (a chunk's `.mlpackage`, compiled once into `cacheDirectory`, or its `.mlmodelc`), reads every
    /// function's interface from the model's own description, and loads `infer` on `computeUnits`.
    public static func open(
        _ url: URL, computeUnits: MLComputeUnits = .cpuAndNeuralEngine, cacheDirectory: URL? = nil
    ) async throws -> CoreMLRunner {
        let name = String(url.lastPathComponent.split(separator: ".").first ?? "")
        guard FileManager.default.fileExists(atPath: url.path) else {
            throw GemmaANEError(.bundle, "\(url.path): missing")
        }
        let compiled: URL
        switch url.pathExtension {
        case "mlpackage": compiled = try await CompiledCache.compiled(url, in: cacheDirectory)
        case "mlmodelc": compiled = url
        default: throw GemmaANEError(.bundle, "\(url.path): expected a .mlpackage or a .mlmodelc")
        }
        let asset: MLModelAsset
        var names: [String]
        do {
            asset = try MLModelAsset(url: compiled)
            names = try await asset.functionNames
        } catch {
            throw GemmaANEError(.bundle, "\(url.path): Core ML cannot read its functions (\(error))")
        }
        let multifunction = names.contains("infer")
        if !multifunction && names.count > 1 {
            throw GemmaANEError(.bundle, "\(url.path): functions \(names.joined(separator: ", ")) but no infer")
        }
        names = multifunction ? ["infer"] + names.filter { $0 != "infer" } : ["infer"]
        let infer = try load(compiled, function: multifunction ? "infer" : nil, on: computeUnits).mapError { error in
            GemmaANEError(.device, "\(url.path): function infer cannot be loaded on \(computeUnits.name) (\(error))")
        }.get()
        var interfaces = ["infer": try interface(infer.modelDescription, of: "\(name).infer", in: url)]
        for function in names.dropFirst() {
            let description: MLModelDescription
            do {
                description = try await asset.modelDescription(of: function)
            } catch {
                throw GemmaANEError(.bundle, "\(url.path): Core ML cannot describe function \(function) (\(error))")
            }
            interfaces[function] = try interface(description, of: "\(name).\(function)", in: url)
        }
        return CoreMLRunner(
            name: name, functionNames: names, interfaces: interfaces, computeUnits: computeUnits,
            compiledURL: compiled, multifunction: multifunction, infer: infer)
    }

    private init(
        name: String, functionNames: [String], interfaces: [String: FunctionInterface], computeUnits: MLComputeUnits,
        compiledURL: URL, multifunction: Bool, infer: MLModel
    ) {
        self.name = name
        self.functionNames = functionNames
        self.interfaces = interfaces
        self.computeUnits = computeUnits
        self.compiledURL = compiledURL
        self.multifunction = multifunction
        self.infer = infer
        models = ["infer": infer]
    }

    /// One function's model (nil: the default function), or the framework's error when the device refuses it.
    private static func load(_ compiled: URL, function: String?, on units: MLComputeUnits) -> Result<MLModel, Error> {
        let configuration = MLModelConfiguration()
        configuration.computeUnits = units
        configuration.functionName = function
        return Result { try MLModel(contentsOf: compiled, configuration: configuration) }
    }

    /// A function's I/O as the model describes it; names sorted (a description is a dictionary).
    private static func interface(_ description: MLModelDescription, of what: String, in url: URL) throws
        -> FunctionInterface
    {
        func specs(_ features: [String: MLFeatureDescription], state: Bool) throws -> [TensorSpec] {
            try features.keys.sorted().compactMap { key in
                guard let feature = features[key] else { return nil }
                let shape = state ? feature.stateConstraint?.bufferShape : feature.multiArrayConstraint?.shape
                let dataType = state ? feature.stateConstraint?.dataType : feature.multiArrayConstraint?.dataType
                if !state && feature.type == .state { return nil }  // a state may be listed among the inputs too
                guard let shape, !shape.isEmpty, let dataType, let dtype = Tensor.DType(dataType) else {
                    throw GemmaANEError(
                        .bundle, "\(url.path): \(what): \(key) is no fixed-shape float16, float32 or int32 array")
                }
                return TensorSpec(name: key, shape: shape.map(\.intValue), dtype: dtype)
            }
        }
        return FunctionInterface(
            inputs: try specs(description.inputDescriptionsByName, state: false),
            outputs: try specs(description.outputDescriptionsByName, state: false),
            states: try specs(description.stateDescriptionsByName, state: true))
    }

    private func io(_ function: String) throws -> FunctionInterface {
        guard let io = interfaces[function] else {
            throw GemmaANEError(.input, "\(name): no function \(function) (has \(functionNames.joined(separator: ", ")))")
        }
        return io
    }

    public func load(_ function: String) throws {
        _ = try io(function)
        if models[function] == nil {
            models[function] = try Self.load(compiledURL, function: function, on: computeUnits).mapError { error in
                GemmaANEError(
                    .functionUnavailable,
                    "\(name): function \(function) cannot be loaded on \(computeUnits.name) (\(error))")
            }.get()
        }
    }

    public func makeState(_ function: String) throws -> ChunkState? {
        if try io(function).states.isEmpty { return nil }
        try load(function)  // a ladder's rung: its states are shaped by its own functions
        guard let model = models[function] else { throw GemmaANEError(.device, "\(name): \(function) not loaded") }
        return CoreMLState(model.makeState())
    }

    /// Drops the models of a rung left behind; `infer` stays, as it was opened with the package.
    public func release(_ functions: [String]) {
        for function in functions where function != "infer" { models[function] = nil }
    }

    public func predict(_ function: String, inputs: [String: Tensor], state: ChunkState?) throws -> [String: Tensor] {
        let io = try io(function)
        try load(function)
        guard let model = models[function] else { throw GemmaANEError(.device, "\(name): \(function) not loaded") }
        var features: [String: MLFeatureValue] = [:]
        for spec in io.inputs {
            guard let tensor = inputs[spec.name] else {
                throw GemmaANEError(.input, "\(name).\(function): input \(spec.name) missing")
            }
            try check(tensor, against: spec, "\(name).\(function): input")
            let array = try MLMultiArray(shape: spec.shape.map { NSNumber(value: $0) }, dataType: spec.dtype.multiArrayDataType)
            try Strided.fill(array, with: tensor)
            features[spec.name] = MLFeatureValue(multiArray: array)
        }
        let output: MLFeatureProvider
        do {
            let provider = try MLDictionaryFeatureProvider(dictionary: features)
            if io.states.isEmpty {
                output = try model.prediction(from: provider)
            } else {
                output = try model.prediction(from: provider, using: try coreMLState(state).state)
            }
        } catch let error as GemmaANEError {
            throw error
        } catch {
            throw GemmaANEError(.device, "\(name).\(function): Core ML prediction failed (\(error))")
        }
        var outputs: [String: Tensor] = [:]
        for spec in io.outputs {
            guard let array = output.featureValue(for: spec.name)?.multiArrayValue else {
                throw GemmaANEError(.device, "\(name).\(function): Core ML returned no output \(spec.name)")
            }
            outputs[spec.name] = try tensor(array, as: spec, "\(name).\(function): output")
        }
        return outputs
    }

    public func readState(_ state: ChunkState, name stateName: String) throws -> Tensor {
        let spec = try stateSpec(stateName)
        return try coreMLState(state).state.withMultiArray(for: stateName) { array in
            try tensor(array, as: spec, "\(name): state")
        }
    }

    public func writeState(_ state: ChunkState, name stateName: String, _ tensor: Tensor) throws {
        let spec = try stateSpec(stateName)
        try check(tensor, against: spec, "\(name): state")
        try coreMLState(state).state.withMultiArray(for: stateName) { array in
            guard array.shape.map(\.intValue) == spec.shape else {
                throw GemmaANEError(.device, "\(name): state \(stateName) has shape \(array.shape), declared \(spec.shape)")
            }
            try Strided.fill(array, with: tensor)
        }
    }

    private func stateSpec(_ stateName: String) throws -> TensorSpec {
        guard let spec = try io("infer").states.first(where: { $0.name == stateName }) else {
            throw GemmaANEError(.input, "\(name): no state \(stateName)")
        }
        return spec
    }

    private func coreMLState(_ state: ChunkState?) throws -> CoreMLState {
        guard let state = state as? CoreMLState else {
            throw GemmaANEError(.input, "\(name): a stateful chunk runs with a state this runner made")
        }
        return state
    }

    private func check(_ tensor: Tensor, against spec: TensorSpec, _ what: String) throws {
        guard tensor.shape == spec.shape, tensor.dtype == spec.dtype else {
            throw GemmaANEError(
                .input,
                "\(what) \(spec.name) is \(tensor.dtype.rawValue) \(tensor.shape), declared \(spec.dtype.rawValue) \(spec.shape)")
        }
    }

    /// A multi-array Core ML handed back, packed through its strides, in the declared shape and dtype.
    private func tensor(_ array: MLMultiArray, as spec: TensorSpec, _ what: String) throws -> Tensor {
        let shape = array.shape.map(\.intValue)
        guard let dtype = Tensor.DType(array.dataType), dtype == spec.dtype, shape.reduce(1, *) == spec.shape.reduce(1, *)
        else {
            throw GemmaANEError(.device, "\(what) \(spec.name) came back as \(shape), declared \(spec.dtype.rawValue) \(spec.shape)")
        }
        return Tensor(shape: spec.shape, dtype: dtype, bytes: try Strided.pack(array, as: dtype))
    }
}
