#if os(macOS) || os(Linux)
import Foundation
import Testing
@testable import GemmaANE

@Test func pipeServerThatCannotOpenItsBundleIsOneError() throws {
    let python = ProcessInfo.processInfo.environment["GEMMA_ANE_PYTHON"]
        ?? EngineGoldens.root.appendingPathComponent(".venv/bin/python").path
    setenv("PYTHONPATH", EngineGoldens.root.path, 1)
    let missing = FileManager.default.temporaryDirectory.appendingPathComponent("no-bundle-\(UUID().uuidString)/chunk_1.mlpackage")
    #expect(throws: GemmaANEError(.device, "gemma_ane.mil.serve: the Python executor exited (status 1; its stderr says why)")) {
        _ = try PipeClient(packages: [missing], python: python)
    }
}

@Test func pipeBundleWithoutChunksIsOneError() throws {
    let empty = FileManager.default.temporaryDirectory.appendingPathComponent("empty-\(UUID().uuidString)")
    try FileManager.default.createDirectory(at: empty, withIntermediateDirectories: true)
    #expect(throws: GemmaANEError(.bundle, "\(empty.path): no chunk_1.mlpackage or chunk_1.mlmodelc")) {
        _ = try PipeRunner.open(bundle: empty, python: "python3")
    }
}

@Test func pipeInterpreterNotFoundIsOneError() throws {
    #expect(throws: GemmaANEError(.input, "no-such-python-3.11: not found on PATH (set --python or GEMMA_ANE_PYTHON)")) {
        _ = try PipeClient(packages: [URL(fileURLWithPath: "/tmp")], python: "no-such-python-3.11")
    }
    #expect(throws: GemmaANEError(.input, "/nonexistent/python: no Python interpreter there (set --python or GEMMA_ANE_PYTHON)")) {
        _ = try PipeClient(packages: [URL(fileURLWithPath: "/tmp")], python: "/nonexistent/python")
    }
}
#endif
