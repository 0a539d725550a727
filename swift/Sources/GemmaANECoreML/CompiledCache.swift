#if canImport(CoreML)
    import CoreML
#else
    import CoreMLStandIn
#endif
import Foundation
import GemmaANE

/// A `.mlpackage` is compiled once: Core ML loads only a compiled `.mlmodelc`, and compiling a 1 GB chunk takes
/// long enough to matter at every launch. The compiled copy lives in `directory` (the app's Caches by default),
/// never beside the package: a bundle holds one form of each chunk (CONTRACT §2), and an app's bundle is
/// read-only. Its name carries a fingerprint of the package (its path, and each file's path, size and
/// modification time), so a changed package compiles again.
enum CompiledCache {
    static var defaultDirectory: URL {
        let caches = FileManager.default.urls(for: .cachesDirectory, in: .userDomainMask).first
        return (caches ?? FileManager.default.temporaryDirectory).appendingPathComponent("gemma-ane")
    }

    static func compiled(_ package: URL, in directory: URL?) async throws -> URL {
        let directory = directory ?? defaultDirectory
        let name = package.deletingPathExtension().lastPathComponent
        let target = directory.appendingPathComponent("\(name)-\(try fingerprint(package)).mlmodelc")
        var isDirectory: ObjCBool = false
        if FileManager.default.fileExists(atPath: target.path, isDirectory: &isDirectory), isDirectory.boolValue {
            return target
        }
        let fresh: URL
        do {
            fresh = try await MLModel.compileModel(at: package)
        } catch {
            throw GemmaANEError(.bundle, "\(package.path): Core ML cannot compile it (\(error))")
        }
        do {
            try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
            // Moved under a name of its own first, then renamed: a reader never sees half a compiled model, and of
            // two processes compiling at once the second finds the first's and keeps it.
            let staging = directory.appendingPathComponent(".\(name)-\(UUID().uuidString).mlmodelc")
            try FileManager.default.moveItem(at: fresh, to: staging)
            do {
                try FileManager.default.moveItem(at: staging, to: target)
            } catch where FileManager.default.fileExists(atPath: target.path) {
                try? FileManager.default.removeItem(at: staging)
            }
        } catch {
            throw GemmaANEError(.device, "\(directory.path): cannot keep the compiled \(name) there (\(error))")
        }
        return target
    }

    /// FNV-1a over the package's path and every file's relative path, size and modification time, in hex.
    static func fingerprint(_ package: URL) throws -> String {
        let keys: [URLResourceKey] = [.isRegularFileKey, .fileSizeKey, .contentModificationDateKey]
        guard let walk = FileManager.default.enumerator(at: package, includingPropertiesForKeys: keys) else {
            throw GemmaANEError(.bundle, "\(package.path): cannot be read")
        }
        var entries: [String] = []
        let root = package.standardizedFileURL.path
        for case let file as URL in walk {
            let values = try file.resourceValues(forKeys: Set(keys))
            guard values.isRegularFile == true else { continue }
            let relative = String(file.standardizedFileURL.path.dropFirst(root.count))
            let time = values.contentModificationDate?.timeIntervalSince1970 ?? 0
            entries.append("\(relative)\t\(values.fileSize ?? 0)\t\(time)")
        }
        var hash: UInt64 = 0xcbf2_9ce4_8422_2325
        for byte in ([root] + entries.sorted()).joined(separator: "\n").utf8 {
            hash = (hash ^ UInt64(byte)) &* 0x100_0000_01b3
        }
        return String(hash, radix: 16)
    }
}
