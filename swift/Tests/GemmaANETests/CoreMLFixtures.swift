import Foundation
import GemmaANE

#if !canImport(CoreML)
    import CoreMLStandIn
#endif

/// The tiny bundles the Core ML runner's tests run, converted by the Python package (never committed): e2b-mini
/// at 16 bits with `infer` and `prefill_b8` and a logits head, and the same checkpoint in the published layout
/// (argmax head). Converted once into a directory named by a fingerprint of the converter's sources (a few
/// minutes on a loaded 2-core machine), or taken from GEMMA_ANE_SWIFT_TEST_BUNDLES (a directory holding
/// `bundle/` and `published/`). The interpreter: GEMMA_ANE_PYTHON, else `.venv/bin/python` at the package root.
enum CoreMLFixtures {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent()
    static let python = ProcessInfo.processInfo.environment["GEMMA_ANE_PYTHON"] ?? root.path + "/.venv/bin/python"
    private static let lock = NSLock()
    nonisolated(unsafe) private static var built: Result<URL, GemmaANEError>?

    /// The directory holding `bundle/` and `published/`; the stand-in's pipe servers run this package's Python.
    static func bundles() throws -> URL {
        try lock.withLock {
            if built == nil {
                setenv("PYTHONPATH", root.path, 1)
                #if !canImport(CoreML)
                    StandInDevice.shared.python = python
                #endif
                built = Result { try build() }.mapError {
                    $0 as? GemmaANEError ?? GemmaANEError(.device, "\($0)")
                }
            }
            return try built!.get()
        }
    }

    private static func build() throws -> URL {
        if let given = ProcessInfo.processInfo.environment["GEMMA_ANE_SWIFT_TEST_BUNDLES"] {
            return URL(fileURLWithPath: given)
        }
        guard FileManager.default.isExecutableFile(atPath: python) else {
            throw GemmaANEError(.input, "\(python): no Python interpreter (run scripts/setup.sh or set GEMMA_ANE_PYTHON)")
        }
        let target = FileManager.default.temporaryDirectory.appendingPathComponent(
            "gemma-ane-swift-coreml-\(try sourcesFingerprint())")
        if FileManager.default.fileExists(atPath: target.appendingPathComponent("published").path) { return target }
        let staging = URL(fileURLWithPath: target.path + ".\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: staging, withIntermediateDirectories: true)
        let ckpt = staging.appendingPathComponent("ckpt").path
        try run(["tiny", ckpt, "--preset", "e2b-mini"])
        let common = ["--bits", "16", "--context", "128", "--no-vision", "--quiet"]
        try run(["convert", ckpt, staging.appendingPathComponent("bundle").path] + common)
        try run(["convert", ckpt, staging.appendingPathComponent("published").path, "--layout", "published"] + common)
        try? FileManager.default.moveItem(at: staging, to: target)  // another process may have won: keep its
        return target
    }

    private static func run(_ arguments: [String]) throws {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: python)
        process.arguments = ["-m", "gemma_ane.cli"] + arguments
        process.standardOutput = FileHandle.nullDevice
        let errors = Pipe()
        process.standardError = errors
        try process.run()
        let said = errors.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        guard process.terminationStatus == 0 else {
            let last = String(decoding: said.suffix(400), as: UTF8.self)
            throw GemmaANEError(.device, "gemma-ane \(arguments[0]) failed: \(last)")
        }
    }

    /// Sizes and modification times of the Python package's sources: a changed converter converts again.
    private static func sourcesFingerprint() throws -> String {
        let package = root.appendingPathComponent("gemma_ane")
        let keys: [URLResourceKey] = [.fileSizeKey, .contentModificationDateKey]
        guard let walk = FileManager.default.enumerator(at: package, includingPropertiesForKeys: keys) else {
            throw GemmaANEError(.bundle, "\(package.path): cannot be read")
        }
        var entries: [String] = []
        for case let file as URL in walk where file.pathExtension == "py" {
            let values = try file.resourceValues(forKeys: Set(keys))
            entries.append("\(file.path) \(values.fileSize ?? 0) \(values.contentModificationDate?.timeIntervalSince1970 ?? 0)")
        }
        var hash: UInt64 = 0xcbf2_9ce4_8422_2325
        for byte in entries.sorted().joined(separator: "\n").utf8 { hash = (hash ^ UInt64(byte)) &* 0x100_0000_01b3 }
        return String(hash, radix: 16)
    }
}
