#if canImport(CoreML)
    import CoreML
#else
    import CoreMLStandIn
#endif
import Foundation
import GemmaANE

extension GemmaModel {
    /// The bundle at `url` with its chunks run by Core ML (on Linux, by the Core ML stand-in over the Python MIL
    /// executor): each `.mlpackage` compiled once into `cacheDirectory` (the app's Caches by default), `infer`
    /// loaded on `computeUnits` now, the prompt functions on first use.
    public static func load(
        _ url: URL, computeUnits: MLComputeUnits = .cpuAndNeuralEngine, cacheDirectory: URL? = nil,
        warn: @escaping (String) -> Void = { _ in }
    ) async throws -> GemmaModel {
        let bundle = try ModelBundle(url)
        var runners: [ChunkRunner] = []
        for path in bundle.chunkPaths {
            runners.append(try await CoreMLRunner.open(path, computeUnits: computeUnits, cacheDirectory: cacheDirectory))
        }
        return try GemmaModel(bundle: bundle, runners: runners, warn: warn)
    }
}
