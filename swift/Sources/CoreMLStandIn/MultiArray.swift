import Foundation

// Core ML's multi-array and feature types, as Apple's SDK names them (iOS 18 / macOS 15), for the runner to compile
// against on Linux. Only what GemmaANECoreML calls is here; see StandInDevice.swift for where predictions go.

public enum MLMultiArrayDataType: Sendable, Equatable {
    case double, float32, float16, int32

    /// Bytes per element.
    var size: Int {
        switch self {
        case .double: 8
        case .float32, .int32: 4
        case .float16: 2
        }
    }
}

/// A multi-dimensional array over storage that may be strided: `strides` (in elements) say where each element
/// lives, as Core ML's do, and a reader that ignores them reads the padding.
public final class MLMultiArray {
    public let shape: [NSNumber]
    public let strides: [NSNumber]
    public let dataType: MLMultiArrayDataType
    private let storage: UnsafeMutableRawPointer
    private let byteCount: Int
    private let deallocator: ((UnsafeMutableRawPointer) -> Void)?

    /// Zeroed, row-major and packed.
    public init(shape: [NSNumber], dataType: MLMultiArrayDataType) throws {
        let dims = shape.map(\.intValue)
        guard dims.allSatisfy({ $0 > 0 }) else {
            throw StandInError("MLMultiArray: shape \(dims) has a dimension below 1")
        }
        var strides = [Int](repeating: 1, count: dims.count)
        for axis in stride(from: dims.count - 2, through: 0, by: -1) {
            strides[axis] = strides[axis + 1] * dims[axis + 1]
        }
        self.shape = shape
        self.strides = strides.map { NSNumber(value: $0) }
        self.dataType = dataType
        byteCount = dims.reduce(1, *) * dataType.size
        storage = UnsafeMutableRawPointer.allocate(byteCount: max(byteCount, 1), alignment: 16)
        storage.initializeMemory(as: UInt8.self, repeating: 0, count: byteCount)
        deallocator = { $0.deallocate() }
    }

    /// Over memory the caller laid out with `strides`; `deallocator` frees it when the array goes.
    public init(
        dataPointer: UnsafeMutableRawPointer, shape: [NSNumber], dataType: MLMultiArrayDataType, strides: [NSNumber],
        deallocator: ((UnsafeMutableRawPointer) -> Void)? = nil
    ) throws {
        guard shape.count == strides.count else {
            throw StandInError("MLMultiArray: \(shape.count) dimensions but \(strides.count) strides")
        }
        let last = zip(shape, strides).map { ($0.intValue - 1) * $1.intValue }.reduce(0, +)
        self.shape = shape
        self.strides = strides
        self.dataType = dataType
        byteCount = (last + 1) * dataType.size
        storage = dataPointer
        self.deallocator = deallocator
    }

    deinit { deallocator?(storage) }

    public var count: Int { shape.reduce(1) { $0 * $1.intValue } }

    /// The storage, padding included; read it through `strides`.
    public func withUnsafeBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) rethrows -> R {
        try body(UnsafeRawBufferPointer(start: storage, count: byteCount))
    }

    /// The storage and its strides in elements, as Core ML hands them (they may differ from a packed layout's).
    public func withUnsafeMutableBytes<R>(_ body: (UnsafeMutableRawBufferPointer, [Int]) throws -> R) rethrows -> R {
        try body(UnsafeMutableRawBufferPointer(start: storage, count: byteCount), strides.map(\.intValue))
    }
}

public final class MLFeatureValue {
    public let multiArrayValue: MLMultiArray?

    public init(multiArray: MLMultiArray) {
        multiArrayValue = multiArray
    }
}

public protocol MLFeatureProvider {
    var featureNames: Set<String> { get }
    func featureValue(for featureName: String) -> MLFeatureValue?
}

public final class MLDictionaryFeatureProvider: MLFeatureProvider {
    public let dictionary: [String: MLFeatureValue]

    /// Values are MLFeatureValue or MLMultiArray, as Core ML takes them; anything else is refused.
    public init(dictionary: [String: Any]) throws {
        var values: [String: MLFeatureValue] = [:]
        for (name, value) in dictionary {
            if let value = value as? MLFeatureValue {
                values[name] = value
            } else if let array = value as? MLMultiArray {
                values[name] = MLFeatureValue(multiArray: array)
            } else {
                throw StandInError("MLDictionaryFeatureProvider: \(name) is neither a feature value nor a multi-array")
            }
        }
        self.dictionary = values
    }

    public var featureNames: Set<String> { Set(dictionary.keys) }

    public func featureValue(for featureName: String) -> MLFeatureValue? { dictionary[featureName] }
}

/// What the stand-in throws where Core ML would throw an NSError: one line.
public struct StandInError: Error, CustomStringConvertible, LocalizedError {
    public let description: String

    init(_ description: String) {
        self.description = description
    }

    public var errorDescription: String? { description }
}
