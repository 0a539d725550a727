import Foundation
import GemmaANE

// Core ML's model, configuration, description and state types, as Apple's SDK names them, over the stand-in's
// device (StandInDevice.swift). Where they differ from Core ML's, by choice: `MLState.withMultiArray(for:)` and the
// asset's queries throw (their I/O crosses a pipe), and a model opens only a `.mlmodelc` this stand-in compiled.

public enum MLComputeUnits: Sendable, Equatable {
    case cpuOnly, cpuAndGPU, all, cpuAndNeuralEngine
}

public final class MLModelConfiguration {
    public var computeUnits: MLComputeUnits = .all
    /// The function of a multifunction model to load; nil: its default function.
    public var functionName: String?

    public init() {}
}

public enum MLFeatureType: Sendable, Equatable {
    case multiArray, state
}

public final class MLMultiArrayConstraint {
    public let shape: [NSNumber]
    public let dataType: MLMultiArrayDataType

    init(shape: [NSNumber], dataType: MLMultiArrayDataType) {
        self.shape = shape
        self.dataType = dataType
    }
}

public final class MLStateConstraint {
    public let bufferShape: [NSNumber]
    public let dataType: MLMultiArrayDataType

    init(bufferShape: [NSNumber], dataType: MLMultiArrayDataType) {
        self.bufferShape = bufferShape
        self.dataType = dataType
    }
}

public final class MLFeatureDescription {
    public let name: String
    public let type: MLFeatureType
    public let multiArrayConstraint: MLMultiArrayConstraint?
    public let stateConstraint: MLStateConstraint?

    init(_ spec: TensorSpec, state: Bool) {
        name = spec.name
        let shape = spec.shape.map { NSNumber(value: $0) }
        let dataType = MLMultiArrayDataType(spec.dtype)
        type = state ? .state : .multiArray
        multiArrayConstraint = state ? nil : MLMultiArrayConstraint(shape: shape, dataType: dataType)
        stateConstraint = state ? MLStateConstraint(bufferShape: shape, dataType: dataType) : nil
    }
}

public final class MLModelDescription {
    public let inputDescriptionsByName: [String: MLFeatureDescription]
    public let outputDescriptionsByName: [String: MLFeatureDescription]
    public let stateDescriptionsByName: [String: MLFeatureDescription]

    init(_ io: FunctionInterface) {
        func byName(_ specs: [TensorSpec], state: Bool) -> [String: MLFeatureDescription] {
            Dictionary(uniqueKeysWithValues: specs.map { ($0.name, MLFeatureDescription($0, state: state)) })
        }
        inputDescriptionsByName = byName(io.inputs, state: false)
        outputDescriptionsByName = byName(io.outputs, state: false)
        stateDescriptionsByName = byName(io.states, state: true)
    }
}

extension MLMultiArrayDataType {
    init(_ dtype: Tensor.DType) {
        switch dtype {
        case .float16: self = .float16
        case .float32: self = .float32
        case .int32: self = .int32
        }
    }

    var dtype: Tensor.DType? {
        switch self {
        case .float16: .float16
        case .float32: .float32
        case .int32: .int32
        case .double: nil
        }
    }
}

/// A compiled model's functions and their descriptions, without loading any for a device.
public final class MLModelAsset {
    let chunk: StandInDevice.Chunk

    public init(url compiledModelURL: URL) throws {
        chunk = try StandInDevice.shared.chunk(compiled: compiledModelURL)
    }

    public var functionNames: [String] {
        get async throws { chunk.runner.functionNames }
    }

    public func modelDescription(of functionName: String) async throws -> MLModelDescription {
        guard let io = chunk.runner.interfaces[functionName] else {
            throw StandInError("\(chunk.source.path): no function \(functionName)")
        }
        return MLModelDescription(io)
    }
}

/// A model's state: the KV caches every function of its package shares. Made on first use, since Core ML's
/// `makeState()` cannot fail and the stand-in's executor can.
public final class MLState {
    let chunk: StandInDevice.Chunk
    /// The function of the model that made it: its states' shapes (a ladder's rungs differ).
    let function: String
    private var made: ChunkState?
    private var isMade = false

    init(chunk: StandInDevice.Chunk, function: String) {
        self.chunk = chunk
        self.function = function
    }

    func state() throws -> ChunkState? {
        if !isMade {
            made = try chunk.runner.makeState(function)
            isMade = true
        }
        return made
    }

    /// The state `stateName` as a multi-array, written back when `body` returns: Core ML hands out a view of the
    /// buffer itself, which a writer changes in place.
    public func withMultiArray<R>(for stateName: String, _ body: (MLMultiArray) throws -> R) throws -> R {
        guard let state = try state() else {
            throw StandInError("\(chunk.source.path): a stateless model has no state \(stateName)")
        }
        let array = try StandInDevice.multiArray(chunk.runner.readState(state, name: stateName), padded: false)
        let result = try body(array)
        try chunk.runner.writeState(state, name: stateName, StandInDevice.tensor(array))
        return result
    }
}

public final class MLModel {
    public let modelDescription: MLModelDescription
    let chunk: StandInDevice.Chunk
    let function: String

    /// Loads one function of a compiled model for `configuration.computeUnits`; a function the stand-in was told
    /// to refuse on the Neural Engine fails here, as an ANE compile failure does.
    public init(contentsOf url: URL, configuration: MLModelConfiguration) throws {
        chunk = try StandInDevice.shared.chunk(compiled: url)
        let names = chunk.runner.functionNames
        function = configuration.functionName ?? names.first ?? "infer"
        guard let io = chunk.runner.interfaces[function] else {
            throw StandInError("\(url.path): no function \(function) (has \(names.joined(separator: ", ")))")
        }
        try StandInDevice.shared.load(chunk, function: function, on: configuration.computeUnits)
        modelDescription = MLModelDescription(io)
    }

    /// Compiles a `.mlpackage` to a new `.mlmodelc` in a temporary directory, as Core ML does.
    public class func compileModel(at modelURL: URL) async throws -> URL {
        try StandInDevice.shared.compile(modelURL)
    }

    /// A fresh state for this model's package, zeroed; every function's model of the package runs with it.
    public func makeState() -> MLState {
        MLState(chunk: chunk, function: function)
    }

    public func prediction(from input: MLFeatureProvider) throws -> MLFeatureProvider {
        try predict(input, state: nil)
    }

    public func prediction(from inputFeatures: MLFeatureProvider, using state: MLState) throws -> MLFeatureProvider {
        guard state.chunk.source == chunk.source else {
            throw StandInError("\(chunk.source.path): a state made by another model (\(state.chunk.source.path))")
        }
        return try predict(inputFeatures, state: state.state())
    }

    private func predict(_ input: MLFeatureProvider, state: ChunkState?) throws -> MLFeatureProvider {
        var tensors: [String: Tensor] = [:]
        for name in input.featureNames {
            guard let array = input.featureValue(for: name)?.multiArrayValue else {
                throw StandInError("\(chunk.source.path): input \(name) is no multi-array")
            }
            tensors[name] = try StandInDevice.tensor(array)
        }
        let outputs = try chunk.runner.predict(function, inputs: tensors, state: state)
        return try MLDictionaryFeatureProvider(
            dictionary: outputs.mapValues { MLFeatureValue(multiArray: try StandInDevice.multiArray($0, padded: true)) }
        )
    }
}
