#if canImport(CoreML)
    import CoreML
#else
    import CoreMLStandIn
#endif
import Foundation
import GemmaANE

// Core ML's multi-arrays may be strided: an output the Neural Engine wrote (fp16 logits above all) can come back
// with each row padded to the engine's alignment, and `strides` say where each element lives. These copies honour
// them: a tensor into a multi-array's storage and back out, packed, one innermost row at a time.

extension Tensor.DType {
    var multiArrayDataType: MLMultiArrayDataType {
        switch self {
        case .float16: .float16
        case .float32: .float32
        case .int32: .int32
        }
    }

    /// The dtype of a multi-array's elements, or nil for one the chunk I/O never carries (doubles).
    init?(_ dataType: MLMultiArrayDataType) {
        if dataType == .float16 {
            self = .float16
        } else if dataType == .float32 {
            self = .float32
        } else if dataType == .int32 {
            self = .int32
        } else {
            return nil
        }
    }
}

enum Strided {
    /// Calls `row(packedOffset, storageOffset)` (in elements) for every innermost row of `shape`.
    static func forEachRow(shape: [Int], strides: [Int], _ row: (Int, Int) -> Void) {
        let outer = shape.dropLast().reduce(1, *)
        let width = shape.last ?? 1
        var index = [Int](repeating: 0, count: max(shape.count - 1, 0))
        for r in 0..<outer {
            var offset = 0
            for axis in index.indices { offset += index[axis] * strides[axis] }
            row(r * width, offset)
            var axis = index.count - 1
            while axis >= 0 {
                index[axis] += 1
                if index[axis] < shape[axis] { break }
                index[axis] = 0
                axis -= 1
            }
        }
    }

    /// Every row's copies between packed memory and strided storage, as byte offsets (packed, stored) and a length:
    /// a row whole where its elements are adjacent, else an element at a time. `pack` and `fill` give the direction.
    static func copyRows(shape: [Int], strides: [Int], size: Int, _ copy: (Int, Int, Int) -> Void) {
        let width = shape.last ?? 1
        let step = strides.last ?? 1
        forEachRow(shape: shape, strides: strides) { packedAt, storedAt in
            if step == 1 {
                copy(packedAt * size, storedAt * size, width * size)
            } else {
                for i in 0..<width {
                    copy((packedAt + i) * size, (storedAt + i * step) * size, size)
                }
            }
        }
    }

    /// The storage bytes a multi-array of `shape` and `strides` must span.
    static func span(shape: [Int], strides: [Int], size: Int) -> Int {
        (zip(shape, strides).map { ($0 - 1) * $1 }.reduce(0, +) + 1) * size
    }

    /// `array`'s elements, packed row-major.
    static func pack(_ array: MLMultiArray, as dtype: Tensor.DType) throws -> Data {
        let shape = array.shape.map(\.intValue)
        let strides = array.strides.map(\.intValue)
        let size = dtype.size
        var packed = Data(count: shape.reduce(1, *) * size)
        try array.withUnsafeBytes { storage in
            guard storage.count >= span(shape: shape, strides: strides, size: size), let source = storage.baseAddress
            else {
                throw GemmaANEError(.device, "a multi-array of shape \(shape) and strides \(strides) is smaller than they say")
            }
            packed.withUnsafeMutableBytes { out in
                guard let target = out.baseAddress else { return }
                copyRows(shape: shape, strides: strides, size: size) { packedAt, storedAt, bytes in
                    (target + packedAt).copyMemory(from: source + storedAt, byteCount: bytes)
                }
            }
        }
        return packed
    }

    /// Writes `tensor` (packed) into `array`'s storage through the strides the storage is handed out with.
    static func fill(_ array: MLMultiArray, with tensor: Tensor) throws {
        let shape = tensor.shape
        let size = tensor.dtype.size
        try array.withUnsafeMutableBytes { storage, strides in
            guard strides.count == shape.count, storage.count >= span(shape: shape, strides: strides, size: size),
                let target = storage.baseAddress
            else {
                throw GemmaANEError(.device, "a multi-array of shape \(shape) and strides \(strides) is smaller than they say")
            }
            tensor.bytes.withUnsafeBytes { packed in
                guard let source = packed.baseAddress else { return }
                copyRows(shape: shape, strides: strides, size: size) { packedAt, storedAt, bytes in
                    (target + storedAt).copyMemory(from: source + packedAt, byteCount: bytes)
                }
            }
        }
    }
}
