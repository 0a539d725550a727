// swift-tools-version: 6.0
// The Swift side of gemma-ane: runs a converted bundle in an iPhone or Mac app.
// Xcode finds a package by repository URL only at the repository root, so this file lives here and the
// sources under swift/ (macOS's case-insensitive file system cannot hold both tests/ and Tests/).
// No outside packages: Foundation everywhere, CoreML where it exists.
import PackageDescription

let package = Package(
    name: "GemmaANE",
    // MLState (stateful KV caches) needs iOS 18 / macOS 15.
    platforms: [.iOS(.v18), .macOS(.v15)],
    products: [
        .library(name: "GemmaANE", targets: ["GemmaANE"]),
        .library(name: "GemmaANECoreML", targets: ["GemmaANECoreML"]),
        .executable(name: "gemma-ane-swift", targets: ["gemma-ane-swift"]),
    ],
    targets: [
        // Plain Swift over bytes: the bundle, host tables, engine, sampling, text and chat format.
        .target(name: "GemmaANE", path: "swift/Sources/GemmaANE"),
        // The Core ML API subset GemmaANECoreML calls, for platforms without CoreML (Linux): it sends each
        // prediction to the Python MIL executor, as tests/coreml_standin.py stands in for Core ML's native layer.
        .target(name: "CoreMLStandIn", dependencies: ["GemmaANE"], path: "swift/Sources/CoreMLStandIn"),
        // The Core ML runner: `import CoreML` where it exists, the stand-in elsewhere.
        .target(
            name: "GemmaANECoreML",
            dependencies: [
                "GemmaANE",
                .target(name: "CoreMLStandIn", condition: .when(platforms: [.linux])),
            ],
            path: "swift/Sources/GemmaANECoreML"
        ),
        .executableTarget(
            name: "gemma-ane-swift",
            dependencies: [
                "GemmaANE", "GemmaANECoreML",
                .target(name: "CoreMLStandIn", condition: .when(platforms: [.linux])),
            ],
            path: "swift/Sources/gemma-ane-swift"
        ),
        // The host-work benchmark bench/swift_host.py builds in release and times (sampling, tokenizer load).
        .executableTarget(name: "gemma-ane-bench", dependencies: ["GemmaANE"], path: "swift/Sources/gemma-ane-bench"),
        .testTarget(
            name: "GemmaANETests",
            dependencies: [
                "GemmaANE", "GemmaANECoreML",
                // the CoreML* tests steer the stand-in (refusals, the interpreter) where it runs
                .target(name: "CoreMLStandIn", condition: .when(platforms: [.linux])),
            ],
            path: "swift/Tests/GemmaANETests"
        ),
    ]
)
