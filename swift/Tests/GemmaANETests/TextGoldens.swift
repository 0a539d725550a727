import Foundation

/// The text side's golden vectors, written by the Python package during the test run (never committed):
/// tests/swift_goldens_text.py OUTDIR, run once per `swift test` with the interpreter GEMMA_ANE_PYTHON names
/// (default: .venv/bin/python at the package root) and the package root on PYTHONPATH.
enum TextGoldens {
    struct Failure: Error, CustomStringConvertible {
        let description: String
    }

    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

    private static let written: Result<URL, Failure> = {
        let environment = ProcessInfo.processInfo.environment
        let python = environment["GEMMA_ANE_PYTHON"] ?? root.appendingPathComponent(".venv/bin/python").path
        guard FileManager.default.isExecutableFile(atPath: python) else {
            return .failure(Failure(description: "no Python interpreter at \(python): run scripts/setup.sh or set GEMMA_ANE_PYTHON"))
        }
        let out = FileManager.default.temporaryDirectory.appendingPathComponent("gemma-ane-text-\(UUID().uuidString)")
        let process = Process()
        process.executableURL = URL(fileURLWithPath: python)
        process.arguments = [root.appendingPathComponent("tests/swift_goldens_text.py").path, out.path]
        var env = environment
        env["PYTHONPATH"] = root.path + (environment["PYTHONPATH"].map { ":" + $0 } ?? "")
        process.environment = env
        let errors = Pipe()
        process.standardError = errors
        do {
            try process.run()
        } catch {
            return .failure(Failure(description: "\(python): \(error)"))
        }
        let message = errors.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        guard process.terminationStatus == 0 else {
            let last = String(decoding: message, as: UTF8.self).split(separator: "\n").last ?? ""
            return .failure(Failure(description: "tests/swift_goldens_text.py exited \(process.terminationStatus): \(last)"))
        }
        return .success(out)
    }()

    /// The directory the writer filled (the first caller waits for it).
    static func directory() throws -> URL { try written.get() }

    /// One JSON file of the goldens, decoded.
    static func json(_ name: String) throws -> Any {
        try JSONSerialization.jsonObject(with: Data(contentsOf: directory().appendingPathComponent(name)))
    }

    static func data(_ name: String) throws -> Data {
        try Data(contentsOf: directory().appendingPathComponent(name))
    }
}
