import Foundation

/// A 2-D `.npy` table (CONTRACT §2: the RoPE rows), mapped, never read whole: format 1.0 or 2.0, C order,
/// little-endian fp16 or fp32. Rows are read one at a time, each as Float.
public struct NpyTable: @unchecked Sendable {
    public let rows: Int
    public let columns: Int
    let data: Data
    let offset: Int
    let isHalf: Bool

    public init(_ url: URL) throws {
        let size = try fileSize(url)
        func bad(_ why: String) -> GemmaANEError { GemmaANEError(.bundle, "\(url.path): not a valid .npy file (\(why))") }
        guard size >= 10 else { throw bad("\(size) bytes") }
        let data: Data
        do {
            data = try Data(contentsOf: url, options: .alwaysMapped)
        } catch {
            throw GemmaANEError(.bundle, "\(url.path): unreadable")
        }
        guard data.prefix(6) == Data([0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59]) else { throw bad("no magic") }
        let major = data[data.startIndex + 6]
        let headerLength: Int
        let start: Int
        if major == 1 {
            headerLength = Int(data[data.startIndex + 8]) | Int(data[data.startIndex + 9]) << 8
            start = 10
        } else if major == 2 || major == 3, size >= 12 {
            headerLength = (0..<4).reduce(0) { $0 | Int(data[data.startIndex + 8 + $1]) << (8 * $1) }
            start = 12
        } else {
            throw bad("format version \(major)")
        }
        guard headerLength <= 65536, start + headerLength <= size,
            let header = String(data: data[(data.startIndex + start)..<(data.startIndex + start + headerLength)], encoding: .utf8)
        else { throw bad("header") }
        let compact = header.replacingOccurrences(of: " ", with: "")
        if compact.contains("'descr':'<f2'") {
            isHalf = true
        } else if compact.contains("'descr':'<f4'") {
            isHalf = false
        } else {
            throw bad("dtype is not little-endian float16 or float32")
        }
        guard compact.contains("'fortran_order':False") else { throw bad("Fortran order") }
        guard let open = compact.range(of: "'shape':("), let close = compact[open.upperBound...].firstIndex(of: ")")
        else { throw bad("no shape") }
        let dims = compact[open.upperBound..<close].split(separator: ",").map { Int($0) }
        guard dims.count == 2, let r = dims[0], let c = dims[1], r >= 0, c >= 0 else { throw bad("shape is not 2-D") }
        self.data = data
        rows = r
        columns = c
        offset = start + headerLength
        let expected = offset + r * c * (isHalf ? 2 : 4)
        guard size == expected else { throw bad("\(size) bytes, expected \(expected) for (\(r), \(c))") }
    }

    /// Row `row` as Float (fp16 widened exactly); the caller keeps `row` below `rows`.
    public func row(_ row: Int) -> [Float] {
        let width = isHalf ? 2 : 4
        let start = data.startIndex + offset + row * columns * width
        return data[start..<(start + columns * width)].withUnsafeBytes { raw in
            (0..<columns).map { i in
                isHalf
                    ? floatFromHalf(raw.loadUnaligned(fromByteOffset: 2 * i, as: UInt16.self).littleEndian)
                    : Float(bitPattern: raw.loadUnaligned(fromByteOffset: 4 * i, as: UInt32.self).littleEndian)
            }
        }
    }
}
