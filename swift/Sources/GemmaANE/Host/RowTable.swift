import Foundation

/// An int8 sidecar [rows, columns] mapped and read by row (CONTRACT §2): the PLE table is 2.35 GB at E2B, so
/// only the rows a token uses are ever touched, and nothing is made resident.
public struct RowTable: @unchecked Sendable {
    public let url: URL
    public let rows: Int
    public let columns: Int
    let data: Data

    public init(_ url: URL, rows: Int, columns: Int) throws {
        let size = try fileSize(url)
        let (expected, overflow) = rows.multipliedReportingOverflow(by: columns)
        guard !overflow, size == expected else {
            throw GemmaANEError(.bundle, "\(url.path): \(size) bytes, expected \(expected) for (\(rows), \(columns)) int8")
        }
        do {
            data = try Data(contentsOf: url, options: .alwaysMapped)
        } catch {
            throw GemmaANEError(.bundle, "\(url.path): unreadable")
        }
        self.url = url
        self.rows = rows
        self.columns = columns
    }

    /// Calls `body` with row `id`'s bytes; an id outside the table is an `.input` error naming the file.
    public func withRow<R>(_ id: Int, _ body: (UnsafeRawBufferPointer) -> R) throws -> R {
        guard id >= 0, id < rows else {
            throw GemmaANEError(.input, "\(url.path): token id \(id) out of range [0, \(rows))")
        }
        let start = data.startIndex + id * columns
        return data[start..<(start + columns)].withUnsafeBytes(body)
    }
}

/// A small fp16 sidecar read whole (one scale per row: 512 KB at E2B), its size checked first.
func readHalfs(_ url: URL, count: Int) throws -> [Float] {
    let size = try fileSize(url)
    guard size == 2 * count else {
        throw GemmaANEError(.bundle, "\(url.path): \(size) bytes, expected \(2 * count) for (\(count),) float16")
    }
    let data = try readBoundedFile(url, limit: 2 * count)
    return data.withUnsafeBytes { raw in
        (0..<count).map { floatFromHalf(raw.loadUnaligned(fromByteOffset: 2 * $0, as: UInt16.self).littleEndian) }
    }
}
