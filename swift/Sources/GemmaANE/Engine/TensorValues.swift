import Foundation

extension Tensor {
    /// `values` in `dtype`, rounded as numpy's astype rounds them (fp16: to nearest, ties to even).
    public init(floats values: [Float], shape: [Int], dtype: DType) {
        var bytes = Data(count: values.count * dtype.size)
        bytes.withUnsafeMutableBytes { raw in
            for (i, v) in values.enumerated() {
                switch dtype {
                case .float16: raw.storeBytes(of: halfBits(v).littleEndian, toByteOffset: 2 * i, as: UInt16.self)
                case .float32: raw.storeBytes(of: v.bitPattern.littleEndian, toByteOffset: 4 * i, as: UInt32.self)
                case .int32: raw.storeBytes(of: (v.isFinite && abs(v) < 2e9 ? Int32(v) : 0).littleEndian, toByteOffset: 4 * i, as: Int32.self)
                }
            }
        }
        self.init(shape: shape, dtype: dtype, bytes: bytes)
    }

    /// Every element as Float (fp16 widened exactly).
    public var floats: [Float] {
        bytes.withUnsafeBytes { raw in
            (0..<count).map { i in
                switch dtype {
                case .float16: return floatFromHalf(raw.loadUnaligned(fromByteOffset: 2 * i, as: UInt16.self).littleEndian)
                case .float32: return Float(bitPattern: raw.loadUnaligned(fromByteOffset: 4 * i, as: UInt32.self).littleEndian)
                case .int32: return Float(Int32(littleEndian: raw.loadUnaligned(fromByteOffset: 4 * i, as: Int32.self)))
                }
            }
        }
    }

    /// This tensor in `dtype` (itself when it is already).
    public func cast(to dtype: DType) -> Tensor {
        dtype == self.dtype ? self : Tensor(floats: floats, shape: shape, dtype: dtype)
    }

    /// Whether every element is finite (an int32 tensor always is).
    public var isFinite: Bool {
        switch dtype {
        case .int32: return true
        case .float16:
            return bytes.withUnsafeBytes { raw in
                (0..<count).allSatisfy { raw.loadUnaligned(fromByteOffset: 2 * $0, as: UInt16.self).littleEndian & 0x7c00 != 0x7c00 }
            }
        case .float32: return floats.allSatisfy(\.isFinite)
        }
    }
}
